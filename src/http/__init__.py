"""lanes.http: the OpenAI-compatible HTTP server."""
