"""Many requests through one target pipeline (``--parallel``): the
continuous-batching scheduler (``scheduler``), its slots and micro-batch
plans (``slots``), their prompt cache (``prefix_cache``), and a lone
request's speculation: its chains and look-ahead rows (``lone_drafts``),
drafted as ``chain_draft`` says.
"""
