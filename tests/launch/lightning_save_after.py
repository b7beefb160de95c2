"""Save a Lightning checkpoint in the middle of a run, as ``ModelCheckpoint`` does (test-only).

``ACCO_TEST_LIGHTNING_SAVE_AFTER="EPOCHS PATH"``: every ``lightning.Trainer`` built in this process gets
a callback that calls ``trainer.save_checkpoint(PATH)`` (every rank: DeepSpeed's sharded checkpoint) at
the end of training epoch EPOCHS, after that epoch's validation, and rank 0 prints
``LIGHTNING_SAVED {"global_step": ..., "epoch": ...}``. The run goes on to its last epoch, so one launch
of the README's command gives both the uninterrupted run and the checkpoint that
tests/integration/test_lightning_example.py resumes (a 2-epoch launch saved it before). Imported by the
``sitecustomize`` that test puts on the ranks' PYTHONPATH (never by the library or the example).
"""
import json
import os

import lightning as L

SAVED_TAG = "LIGHTNING_SAVED"


class SaveAfter(L.Callback):
    def __init__(self, epochs: int, path: str):
        self.epochs, self.path = epochs, path

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch + 1 == self.epochs:
            trainer.save_checkpoint(self.path)
            if trainer.is_global_zero:
                print(f"{SAVED_TAG} " + json.dumps({"global_step": trainer.global_step,
                                                    "epoch": trainer.current_epoch}), flush=True)


_epochs, _path = os.environ["ACCO_TEST_LIGHTNING_SAVE_AFTER"].split(" ", 1)
_init = L.Trainer.__init__


def _init_with_save(self, *args, callbacks=None, **kwargs):
    callbacks = [callbacks] if isinstance(callbacks, L.Callback) else list(callbacks or [])
    _init(self, *args, callbacks=[*callbacks, SaveAfter(int(_epochs), _path)], **kwargs)


L.Trainer.__init__ = _init_with_save
