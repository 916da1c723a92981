"""Live instance state: what the gateway knows of each instance now (:mod:`.instance`, over the
shadow replica, published snapshots and scraped load), its in-flight attempts (:mod:`.flight`,
:mod:`.ledger`), health, the gateway's own load, the pollers and KV events that keep it fresh,
the other gateway replicas (:mod:`.peers`), and the attempt lifecycle whose events feed it
(:mod:`.lifecycle`)."""
