"""The relay: the completion routes of ``duetime serve`` (:mod:`.handler`), a request's attempts
and retries (:mod:`.retries`), one attempt's upstream stream (:mod:`.attempt`) and the
reassembly of a stream into a non-streaming answer (:mod:`.reassembly`)."""
