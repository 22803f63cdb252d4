"""Speculative decoding in the child: its config, the n-gram proposer and verifier, the draft model and
the EAGLE-3 head. May import models/, sampling/, attention/ and step/'s value types; never the runtime itself."""
