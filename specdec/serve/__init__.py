"""`specdec serve`: an OpenAI-compatible HTTP server with batched speculative decoding.

- `app`: `create_app(decoder)`, the FastAPI app (completions, chat completions, models, health, metrics);
- `scheduler`: the decode worker (lanes of rolling batches over `specdec.engine.DecodeSession`);
- `schemas`: request and response bodies; `errors`: OpenAI-style error bodies;
- chat prompts and incremental detokenization with stop strings: `specdec.text` (shared with the CLI and the API);
- `metrics`: Prometheus metrics (`prometheus_client`); `server`: running it with uvicorn, draining on shutdown.
Design and usage: docs/serving.md.
"""

from specdec.serve.app import create_app
from specdec.serve.server import BackgroundServer, serve

__all__ = ["BackgroundServer", "create_app", "serve"]
