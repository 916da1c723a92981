"""The intake: a request's bytes and headers become one context (:mod:`.request`) — API keys and
rate limits (:mod:`.auth`, :mod:`.ratelimit`), controls (:mod:`.controls`), the policy it is
routed by (:mod:`.policies`), its candidates and predictions (:mod:`.predictions`) — and the
admission rule by priority that the router applies (:mod:`.admission`)."""
