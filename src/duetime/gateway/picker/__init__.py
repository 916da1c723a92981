"""The endpoint picker (``duetime epp``): Envoy's ``ext_proc`` protocol as the Gateway API
Inference Extension speaks it (:mod:`.messages`), one exchange per Envoy stream
(:mod:`.exchange`), the instances' addresses (:mod:`.endpoints`) and the gRPC service
(:mod:`.service`). Needs the ``epp`` extra (grpcio, xds-protos); nothing else in the gateway
imports this package."""
