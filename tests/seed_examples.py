"""Code from the seed document, verbatim, shared by the tests that prove it runs unchanged."""


# Section 4.2: a user-defined loss scaler plugged in through initialize(loss_scaler=...).
class CustomLossScaler:
    def __init__(self, init_scale=2**16):
        self.current_scale = init_scale
        self.scale_factor = 2
        self.unscaled_loss = 0
    def update_scale(self, has_overflow):
        if has_overflow:
            self.current_scale /= self.scale_factor
        else:
            self.current_scale *= self.scale_factor
