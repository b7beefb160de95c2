"""examples/lightning_train.py with a LightningModule that keeps its modules in training mode during
validation (``on_validation_model_eval`` overridden, as for Monte-Carlo dropout): Lightning then never
calls ``engine.eval()``, and validation must still evaluate the committed weights θ."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
from lightning_train import Regressor, main  # noqa: E402


class TrainModeValidation(Regressor):
    def on_validation_model_eval(self):
        pass  # Lightning's default: self.trainer.model.eval()

    def on_validation_model_train(self):
        pass


if __name__ == "__main__":
    main(module_class=TrainModeValidation)
