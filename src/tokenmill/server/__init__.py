"""OpenAI-compatible HTTP server (`tokenmill serve`): see api_server.py for the routes."""
