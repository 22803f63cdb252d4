"""On-device sampling: the sampler, its counter-based seeds, and the grammar rows that mask logits
before it. Imports nothing else of the child."""
