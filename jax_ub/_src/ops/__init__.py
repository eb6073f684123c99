"""The public ops: each a front end that checks its call once and a body on a rank's rows,
run by one driver (``driver.py``); their custom VJPs, fp8 variants, and which path a call
takes."""
