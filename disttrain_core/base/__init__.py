"""The bottom layer, which every other may use: torch-version differences (torch_compat), DTensor helpers,
device clocks, sockets, helper processes, fault injection, and the process environment of a launch
(launch_env: local, torchrun, srun). Nothing here imports another package of disttrain_core."""
