"""Train a model.

    python train.py                                  # mllm_tiny on the embedded data, CPU
    python train.py recipe=mllm_tiny_ddp2            # a preset from recipes/
    python train.py trainer.devices=2 optim.lr=1e-3  # any override
    python train.py -m optim.lr=1e-3,3e-4            # a sweep

Configuration mistakes are reported in one line before anything starts.
"""

import sys

from disttrain_core.base.startup import uncollected_imports

with uncollected_imports():  # no collector over the imports (base/startup.py; torch's come in check_overrides)
    import hydra

    from disttrain_core.config import register_configs
    from disttrain_core.launch.cli import exit_now, preflight

    register_configs()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg) -> float | None:
    from disttrain_core.launch import launch

    return launch(cfg)


if __name__ == "__main__":
    preflight(sys.argv[1:])
    try:
        main()
    except SystemExit as done:
        exit_now(done.code)
    exit_now(0)
