"""The director's stages, in the order a request meets them (``extproc.gateway`` runs them):

    identity    request headers: ids and trace, limits, path and method, the key's tenant and class
    analysis    the body: bounded parse, validation, token estimate, rules; semantic routing
    resolution  the served model and pool: breakers and fallback chains, degradation, shedding
    admission   the reservation, and the quota store's verdict
    cache       the response cache: exact key, paraphrase, hot key warm-up, stale copies
    route       the pods, the headers and the decision metadata that go on with the request

Each stage is pure (no I/O): it reads and writes the request's ``RequestState``, and answers with a
reply, an effect for the shell to run (handed back to the stage's continuation), or None: on to the
next stage.
"""
