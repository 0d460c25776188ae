"""Speculative decoding only while it pays (`spec:`): with `spec.when: alone` the wrapper drops the draft (a
reload, the degradation ladder's `disable-spec` change) when more than one request has been decoding at once
for `spec.calm`, and brings it back after `spec.calm` with at most one, unless it has measured that the draft
does not pay alone either. The rule is a pure function (rule.py) fed with tokens/s the answers' own `timings`
report, alone and in a crowd, with and without the draft.

settings, state (what is measured), rule (the decision), fit (the argv), track (each request: how many decode
beside it, its timings), control (the background switch), report (status).
"""

from __future__ import annotations

FAMILY = "spec"
