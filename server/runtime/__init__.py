"""The runtime: the scheduler core (server/scheduler) driven by real time in front of a real
engine (server/engine). The live scheduler, admission, agents and their lifecycle, their
listeners (history, metrics, predictor feedback), what a restart learns again, shutdown.

It knows nothing of HTTP (server/api imports it, never the reverse) nor of the simulator.
"""
