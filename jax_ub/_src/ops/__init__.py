"""The public ops: entry points, custom VJPs, fp8 variants, and which path a call takes."""
