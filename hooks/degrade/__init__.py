"""Built-in degradation under a memory budget (`degrade:` in the config).

At every start and reload the child's argv is fitted to the budget (`fit`): the ladder's rungs are planned
(`ladder`, hooks/degrade/memory.py, calibrated by `calibration`) and the chosen rung runs with the largest context that
fits. The chosen rung is the best one, unless a growth, a relax or a budget change asked for another
(`control`): a request that overflows the context makes the wrapper reload to the first rung whose context
holds it, then send the same request again; idle long enough, it relaxes back up to the best rung that holds
every conversation. What a generation reports (buffers, status, GET /wrapper/memory) is `report`; what lives
as long as the wrapper is `state`; the `degrade:` keys are `settings`.
"""

FAMILY = "degrade"
TURN_ON = "add a degrade: section to the config (at least degrade: {budget: auto})"
