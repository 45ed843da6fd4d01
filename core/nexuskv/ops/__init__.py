"""Operating the kernel: decision logs, capture and replay, shadow evaluation, policy operations and metrics.

`decision_log.py` renders and counts every plan's decision line; `capture.py` keeps a plan's inputs and
`replay.py` decides them again under another revision (`shadow.py`, `nexuskv policy diff`); `policy_ops.py` runs
reloads, shadows and rollouts; `metrics.py` serves Prometheus series and `/status` from the `counters.py` the
kernel's parts keep.
"""
