"""Serving: the engine worker processes (one per rank), the server that queues requests, restarts
dead workers and streams events, the client side of a submission, and what a client needs to know of
the model before it is loaded.

The top layer: may import everything of `engine`. The web UI imports only this package's client
API, the events and the requests.
"""
