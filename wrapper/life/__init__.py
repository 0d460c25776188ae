"""llama-server's life: the supervisor (signals, the watch, the exit status), the one owner that starts, restarts,
sleeps, wakes, drains and stops it (server_life, by the table of occasions), the watch and the watchdog, the
sleep's cycle, the reload's cycle and the hooks run at each moment."""
