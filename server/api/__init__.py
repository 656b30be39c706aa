"""The HTTP layer: the FastAPI application, its routes, request and response bodies,
errors, tenancy, limits on what a request may ask, health and the dashboard.

It turns HTTP into calls on the runtime (server/runtime) and never reaches below it into
the scheduler core for anything but plain data; nothing under it imports this package.
"""
