"""Optimizers the Horovod Keras walkthrough uses that Keras 3 does not ship: ``NovoGrad``.

Keras's own large-batch optimizer, ``keras.optimizers.Lamb``, works with
``DistributedOptimizer`` as it is.
"""

from __future__ import annotations

import keras
from keras import ops


@keras.saving.register_keras_serializable(package="roundel")
class NovoGrad(keras.optimizers.Optimizer):
    """NovoGrad (Ginsburg et al., 2019): SGD with momentum on gradients normalized by a per-layer second moment.

    For each variable ``w`` (a "layer") with gradient ``g`` at step t::

        v_t = ||g||^2                                  (t = 1)
        v_t = beta_2 * v_{t-1} + (1 - beta_2) * ||g||^2  (t > 1)
        d_t = g / (sqrt(v_t) + epsilon) + weight_decay * w
        m_t = beta_1 * m_{t-1} + c * d_t                 (c = 1 - beta_1 with grad_averaging, else 1)
        w   = w - learning_rate * m_t

    ``v`` is one number per variable. With ``amsgrad`` the largest ``v`` seen
    so far is used in ``d_t``. ``weight_decay`` is NovoGrad's own (inside the
    moment, as in the paper), not Keras's decoupled weight decay. Arguments are
    those of ``tensorflow_addons.optimizers.NovoGrad``, plus Keras's common
    optimizer arguments (``clipnorm``, ``gradient_accumulation_steps``, ...).

    Raises ValueError for ``beta_1`` or ``beta_2`` outside [0, 1), ``epsilon``
    <= 0 or ``weight_decay`` < 0.
    """

    def __init__(self, learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-7, weight_decay=0.0,
                 grad_averaging=False, amsgrad=False, name="NovoGrad", **kwargs):
        for label, beta in (("beta_1", beta_1), ("beta_2", beta_2)):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"NovoGrad: {label}={beta} must be in [0, 1)")
        if not epsilon > 0.0:
            raise ValueError(f"NovoGrad: epsilon={epsilon} must be > 0")
        if weight_decay is None or weight_decay < 0.0:
            raise ValueError(f"NovoGrad: weight_decay={weight_decay} must be >= 0")
        # Keras's weight_decay argument means decoupled decay; NovoGrad's is its own (see update_step).
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        self.beta_1, self.beta_2, self.epsilon = beta_1, beta_2, epsilon
        self.novograd_weight_decay = weight_decay
        self.grad_averaging, self.amsgrad = bool(grad_averaging), bool(amsgrad)

    def build(self, var_list):
        """Create the moment ``m`` (shaped like each variable) and the per-variable scalar ``v`` (and max ``v``)."""
        if self.built:
            return
        super().build(var_list)
        self._momentums = self.add_optimizer_variables(var_list, "momentum")
        self._norms = [self._scalar(v, "norm") for v in var_list]
        self._max_norms = [self._scalar(v, "max_norm") for v in var_list] if self.amsgrad else []

    def _scalar(self, reference, what):
        return self.add_variable((), dtype=reference.dtype, name=f"{reference.path.replace('/', '_')}_{what}")

    def update_step(self, gradient, variable, learning_rate):
        """Apply one NovoGrad step to ``variable``."""
        dtype = variable.dtype
        index = self._get_variable_index(variable)
        lr = ops.cast(learning_rate, dtype)
        gradient = ops.cast(gradient, dtype)
        m, v = self._momentums[index], self._norms[index]
        squared_norm = ops.sum(ops.square(gradient))
        v_t = ops.where(ops.equal(self.iterations, 0), squared_norm,
                        self.beta_2 * v + (1.0 - self.beta_2) * squared_norm)
        self.assign(v, v_t)
        if self.amsgrad:
            v_max = self._max_norms[index]
            v_t = ops.maximum(v_max, v_t)
            self.assign(v_max, v_t)
        direction = gradient / (ops.sqrt(v_t) + self.epsilon)
        if self.novograd_weight_decay:
            direction = direction + self.novograd_weight_decay * variable
        if self.grad_averaging:
            direction = direction * (1.0 - self.beta_1)
        self.assign(m, self.beta_1 * m + direction)
        self.assign_sub(variable, lr * m)

    def get_config(self):
        """The constructor arguments (NovoGrad's ``weight_decay`` in place of Keras's)."""
        config = super().get_config()
        config.update({"beta_1": self.beta_1, "beta_2": self.beta_2, "epsilon": self.epsilon,
                       "weight_decay": self.novograd_weight_decay, "grad_averaging": self.grad_averaging,
                       "amsgrad": self.amsgrad})
        return config
