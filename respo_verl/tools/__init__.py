"""The product's tools, each a keyword API plus its ``cli.py``: ``plan`` (layouts and memory), ``sweep`` (the
comparison grid), ``report`` (late scores and plots), ``runs`` (manifests, logs and per-run statistics)."""
