"""``ggpipe serve``: the OpenAI-compatible HTTP server on the head rank.

``server`` (the job: the ranks, the request loop's thread, shutdown),
``app`` (the FastAPI routes), ``bodies`` and ``replies`` (what a request
holds and what its answer looks like), ``slots`` (the request loop that
feeds the engine), ``state`` (what the routes and the loop share),
``metrics`` (``GET /metrics``), and the HTTP guards: ``http_protocol``
(the server's own HTTP/1.1 limits), ``http_limits`` (connections, read
time-outs), ``http_guard`` (hosts, origins, body sizes). With ``--ranks``
(no ``mpiexec``): ``front`` (the front end that outlives the job) and
``resume`` (what it and the job's server say about a stream to go on with).
"""
