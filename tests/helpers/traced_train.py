"""``python -m traced_train ARGS``: ``arlopti_jax.train`` with the order of its dispatches and waits
recorded (the sampling loop's overlap, rl/pipeline.py), one JSON list per process in
``$TRACE_DIR/events_<process>.json``; with ``TRACE_SERIAL=1`` the sampler's programs are dispatched
only once the update has finished (``one_after_another``), the non-overlapped run of the same
schedule. Run under ``launch/local.sh --module traced_train`` for several processes."""

import json
import os
import sys

from arlopti_jax.runtime import process

process.prepare()

from arlopti_jax import algos  # noqa: E402
from arlopti_jax.rl import loop, update  # noqa: E402
from arlopti_jax.rollout import sampler  # noqa: E402

EVENTS: list = []
STEP = {"now": None}


def record(*event):
    EVENTS.append([STEP["now"], *event])


def install(patch=None):
    """The spies: the update's first turn, a decode loop dispatched by the sampler, the update's last
    program dispatched, the wait for the update's results; each event tagged with the trainer's step.
    ``patch``: a pytest ``MonkeyPatch`` (in a test's own process: undone after it), else the functions
    are replaced."""
    put = patch.setattr if patch is not None else setattr
    loops = sampler.Sampler._decode_loops

    def decode_loops(self, *args, **kwargs):
        steps = loops(self, *args, **kwargs)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value
            record("sampler dispatched a decode loop")
            yield

    put(sampler.Sampler, "_decode_loops", decode_loops)
    dispatch = algos.update_on_batch

    def update_on_batch(*args, **kwargs):
        out = dispatch(*args, **kwargs)
        record("update dispatched")
        return out

    put(algos, "update_on_batch", update_on_batch)  # rl/update.py calls it through the package
    finish = update.Update.finish

    def traced_finish(self, updater):
        record("update waited for")
        return finish(self, updater)

    put(update.Update, "finish", traced_finish)
    steps = update.Updater.steps

    def traced_steps(self, *args, **kwargs):
        record("update began")
        return (yield from steps(self, *args, **kwargs))

    put(update.Updater, "steps", traced_steps)
    step = loop.Trainer.step

    def traced_step(self, index):
        STEP["now"] = index
        return step(self, index)

    put(loop.Trainer, "step", traced_step)


def one_after_another(*tasks, on_turn=None):
    """``run_together`` without the overlap: each task to its end in turn, the update's programs waited
    for before the sampler's are dispatched."""
    import jax

    for task in sorted((t for t in tasks if t is not None), key=lambda t: t.name != "update"):  # the update first
        while not task.done:
            task.turn()
        if task.name == "update":
            jax.block_until_ready(task.value.params)
            record("update waited for")


def main():
    install()
    if os.environ.get("TRACE_SERIAL") == "1":
        loop.run_together = one_after_another
    from arlopti_jax import train
    from arlopti_jax.config.cli import define_config_file, parse_command_line

    status = 1
    try:
        status = train.main(parse_command_line(sys.argv, train.COMMAND, define_config_file))
    finally:
        import jax

        folder = os.environ.get("TRACE_DIR")
        if folder:
            with open(os.path.join(folder, f"events_{jax.process_index()}.json"), "w") as f:
                json.dump(EVENTS, f)
    sys.exit(status)


if __name__ == "__main__":
    main()
