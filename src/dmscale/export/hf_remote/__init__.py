"""Self-contained modeling files that travel with a saved checkpoint (``auto_map``).

The files here import only ``torch`` and ``transformers``: :func:`dmscale.save_pretrained`
copies them next to the weights, and ``from_pretrained(dir, trust_remote_code=True)`` loads
them without dmscale. Nothing in dmscale imports them.
"""

__all__: list[str] = []
