"""From the ops to XLA: primitives, custom-call operands, the unfused reference ops, placement."""
