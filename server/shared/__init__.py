"""Plain data the layers share and the simulator reads too: what an engine step took, the
step-time model's coefficients, engine profiles. Imports nothing else from the server.
"""
