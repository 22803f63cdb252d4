"""The step contract in the child: ChipRuntime, its pooled tensors, row fields and state, chunk layout,
decode graphs, warm-up. May import models/, sampling/, spec/, attention/ and the child's config and protocol."""
