"""Benchmark orchestration: the `justitia bench` commands.

They drive the simulator (server/sim) and, for `bench live`, start real servers and replay
workloads through them over HTTP. They live outside `server/` because the server never runs
them: the server and the simulator are what they measure.

- commands.py: the parsers; options.py: the options they share;
- sim.py: `sim`, `make-workload`, `calibrate`, `starvation`;
- live.py and live_run.py: `live` (the command; one server per policy, the replay);
- family.py: `family`, the evaluation family of arrival shapes.
"""
