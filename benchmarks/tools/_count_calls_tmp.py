import collections, re, sys
from jax_ub.bench import model
margs = model._parser().parse_args(sys.argv[1:])
cfg, mesh, tokens = model.setup(margs)
step, state, _ = model.compiled_step("jax_ub", cfg, mesh, tokens, margs)
t = step.as_text()
names = re.findall(r'custom_call_target="(jax_ub_[a-z_]+)"', t)
print("jax_ub custom calls in the compiled step:", collections.Counter(names), "dynamic-slice fusions:", t.count("calls=%dynamic-slice-fusion"))
