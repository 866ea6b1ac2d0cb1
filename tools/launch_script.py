"""Print what a recipe's header means as a job, for people who submit by hand (docs/RECIPES.md).

    python tools/launch_script.py recipe=mllm9b_disagg_2node                 # the sbatch script (2 nodes)
    python tools/launch_script.py recipe=llama3_70b_3d data.path=/data/tokens.npy > job.sbatch && sbatch job.sbatch
    python tools/launch_script.py recipe=llama3_8b_fsdp2 data.path=/data/tokens.npy   # one node: the torchrun command
    python tools/launch_script.py recipe=mllm15b_auto_a100                   # parallel=auto: the nodes its plan uses

Options: ``recipe=<name>`` (required), ``nodes=<count>`` (trainer.num_nodes; for a ``parallel=auto`` recipe the
nodes to plan for, and the job gets the ones the plan uses), ``format=auto|sbatch|torchrun`` (auto: torchrun
for one node, sbatch otherwise), ``launcher=<preset of conf/hydra/launcher>`` (default slurm). ``hydra.launcher.*``
overrides set the script (e.g. ``hydra.launcher.partition=gpu``); everything else, ``hydra.run.dir`` too, overrides
the recipe (e.g. ``data.path=...``) and is passed to every rank. The jobs' logs go to outputs/slurm/ (made now:
SLURM does not create an --output folder).

The ``#SBATCH`` lines are the ones ``python train.py -m recipe=<name> hydra/launcher=slurm`` submits (the same
launcher preset through submitit's own writer). The job is validated first as the cluster will validate it:
a GPU cluster preset with too few GPUs or too little memory for the recipe's layout is one ``error:`` line.
"""

from __future__ import annotations

import sys

from disttrain_core.launch.cli import split_tool_args, tool_main
from disttrain_core.validation import ConfigError


def main(argv: list[str]) -> int:
    from disttrain_core.launch.cluster import compose_job, launch_text

    options, overrides = split_tool_args(argv, {"recipe": "", "nodes": "", "format": "auto", "launcher": "slurm"})
    if not options["recipe"]:
        raise ConfigError("recipe=<name> is required, e.g. python tools/launch_script.py recipe=mllm9b_disagg_2node")
    nodes = None
    if options["nodes"]:
        if not options["nodes"].isdigit() or int(options["nodes"]) < 1:
            raise ConfigError(f"nodes={options['nodes']}: give a positive number of nodes")
        nodes = int(options["nodes"])
    launcher = options["launcher"]
    job = compose_job(options["recipe"], overrides, nodes=nodes, launcher=launcher)
    print(launch_text(job, options["format"]), end="")
    return 0


if __name__ == "__main__":
    sys.exit(tool_main(main, sys.argv[1:]))
