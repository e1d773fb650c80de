"""OpenAI-compatible HTTP server: `create_app(engine_or_config)` builds the FastAPI app.

Imported lazily so that `speculant --help` never pays for FastAPI.
"""

__all__ = ["create_app"]


def __getattr__(name):
    if name == "create_app":
        from speculant.server.app import create_app
        return create_app
    raise AttributeError(name)
