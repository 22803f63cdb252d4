"""Scale-out plumbing: tensor-parallel nodes and their followers, data-parallel links, relay and
router. May import engine/ and worker/; the headless node and relay also serving/'s engine-core wire."""
