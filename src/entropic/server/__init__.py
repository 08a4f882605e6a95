"""OpenAI-compatible HTTP server over the engine (`entropic serve`); see app.build_app."""
