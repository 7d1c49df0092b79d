"""`fgchat serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one engine process.

Layout: cli (options), run (start-up: bind, engine, uvicorn), hub (the shared engine and its event
pump), app (routes), schemas (request bodies), choices/stops/shapes (events to OpenAI output),
metrics (Prometheus), errors (OpenAI error bodies).
The engine never imports anything from here.
"""
