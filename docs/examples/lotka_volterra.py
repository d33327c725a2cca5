"""A simulator returning a trajectory, with its vjp: Lotka-Volterra predator and prey.

The worked example of the user guide's page "Remote models over UM-Bridge"
(``docs/user-guide/umbridge.md``).  One class is both

* a remote model's class: ``solve(theta)`` returns the trajectory, ``solve_vjp(theta, g)``
  its vector-Jacobian product, for ``model.arrays_to_arrays_op("solve", ..., vjp=...)``;
* an ``umbridge.Model``: ``__call__`` and ``gradient`` are the same two, for
  ``dt.serve_umbridge`` and any UM-Bridge client.

The solver is a fixed-step fourth-order Runge-Kutta scheme; it integrates the forward
sensitivities ``S = du/dtheta`` beside the state with the same scheme, which makes them
the exact derivative of the discrete solution (to round-off), so that the gradient NUTS
gets is the gradient of the trajectory it gets.  ``lotka_volterra_pt`` writes the same
scheme in PyTensor, for comparison.
"""

from __future__ import annotations

import numpy as np
import umbridge

#: observation times, and the Runge-Kutta steps between two of them
TIMES = np.arange(0.0, 12.5, 1.0)
SUBSTEPS = 4
STEP = (TIMES[1] - TIMES[0]) / SUBSTEPS
#: the initial populations (prey, predators)
U0 = np.array([10.0, 5.0])
#: the parameters the data are drawn from: prey growth, predation, predator death, growth
TRUE = np.array([1.0, 0.1, 1.5, 0.075])


def _rhs(u, theta):
    """The populations' rates of change, the Jacobian in ``u``, and in ``theta``."""
    (x, y), (a, b, c, d) = u, theta
    f = np.array([a * x - b * x * y, d * x * y - c * y])
    dfdu = np.array([[a - b * y, -b * x], [d * y, d * x - c]])
    dfdtheta = np.array([[x, -x * y, 0.0, 0.0], [0.0, 0.0, -y, x * y]])
    return f, dfdu, dfdtheta


def _step(u, s, theta):
    """One Runge-Kutta step of the state ``u`` and of its sensitivities ``s`` (2 x 4)."""
    stages, slopes = [], []
    for weight in (0.0, 0.5, 0.5, 1.0):
        ui = u + weight * STEP * (stages[-1] if stages else 0.0)
        si = s + weight * STEP * (slopes[-1] if slopes else 0.0)
        f, dfdu, dfdtheta = _rhs(ui, theta)
        stages.append(f)
        slopes.append(dfdu @ si + dfdtheta)
    u = u + STEP / 6 * (stages[0] + 2 * stages[1] + 2 * stages[2] + stages[3])
    s = s + STEP / 6 * (slopes[0] + 2 * slopes[1] + 2 * slopes[2] + slopes[3])
    return u, s


def simulate(theta) -> tuple[np.ndarray, np.ndarray]:
    """The trajectory at ``TIMES`` (prey then predators at each time, flattened: 2n) and
    its Jacobian in ``theta`` (2n x 4)."""
    theta = np.asarray(theta, dtype=float)
    u, s = U0.copy(), np.zeros((2, 4))
    path, sens = [u], [s]
    with np.errstate(over="ignore", invalid="ignore"):  # far from the data, it blows up
        for _ in TIMES[1:]:
            for _ in range(SUBSTEPS):
                u, s = _step(u, s, theta)
            path.append(u)
            sens.append(s)
    path = np.concatenate(path)
    if not np.isfinite(path).all():  # blown up: infinite (the likelihood is then -inf, and
        path[:] = np.inf  # NUTS counts a divergence), as lotka_volterra_pt says too
    return path, np.concatenate(sens)


class LotkaVolterra(umbridge.Model):
    """The simulator, built once per worker; it keeps the Jacobians of its last solutions,
    so that the vjp of a point it solved costs a matrix product (the vjp's call reaches
    the replica that solved its point while it still holds it)."""

    def __init__(self, keep: int = 64):
        super().__init__("lotka-volterra")
        self.keep = keep
        self.jacobians: dict[bytes, np.ndarray] = {}

    # -- as a remote model: an Op with a vjp ------------------------------------------------

    def solve(self, theta: np.ndarray) -> np.ndarray:
        path, jac = simulate(theta)
        if len(self.jacobians) >= self.keep:
            self.jacobians.pop(next(iter(self.jacobians)))
        self.jacobians[np.asarray(theta, dtype=float).tobytes()] = jac
        return path

    def solve_vjp(self, theta: np.ndarray, g: np.ndarray) -> np.ndarray:
        jac = self.jacobians.get(np.asarray(theta, dtype=float).tobytes())
        if jac is None:  # solved elsewhere, or long ago
            jac = simulate(theta)[1]
        return g @ jac

    # -- as a UM-Bridge model ---------------------------------------------------------------

    def get_input_sizes(self, config):
        return [4]

    def get_output_sizes(self, config):
        return [2 * len(TIMES)]

    def __call__(self, parameters, config):
        return [self.solve(np.array(parameters[0])).tolist()]

    def gradient(self, out_wrt, in_wrt, parameters, sens, config):
        return self.solve_vjp(np.array(parameters[0]), np.array(sens)).tolist()

    def supports_evaluate(self):
        return True

    def supports_gradient(self):
        return True


def lotka_volterra_pt(theta):
    """The same trajectory written in PyTensor (PyTensor differentiates it itself): the
    same Runge-Kutta steps, in a ``scan`` over the observation times."""
    import pytensor
    import pytensor.tensor as pt

    def rhs(u, theta):
        (x, y), (a, b, c, d) = (u[0], u[1]), (theta[0], theta[1], theta[2], theta[3])
        return pt.stack([a * x - b * x * y, d * x * y - c * y])

    def interval(u, theta):  # theta passed in, not captured: PyMC replaces it in the scan
        for _ in range(SUBSTEPS):
            k1 = rhs(u, theta)
            k2 = rhs(u + 0.5 * STEP * k1, theta)
            k3 = rhs(u + 0.5 * STEP * k2, theta)
            k4 = rhs(u + STEP * k3, theta)
            u = u + STEP / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
        return u

    u0 = pt.as_tensor_variable(U0)
    path = pytensor.scan(interval, outputs_info=[u0], non_sequences=[theta],
                         n_steps=len(TIMES) - 1, return_updates=False)  # fmt: skip
    path = pt.concatenate([u0[None, :], path]).ravel()
    blown_up = pt.any(pt.isnan(path) | pt.isinf(path))
    return pt.switch(blown_up, np.inf, path)


def observed(seed: int = 42, sigma: float = 1.0) -> np.ndarray:
    """Noisy populations drawn from the trajectory at ``TRUE``."""
    return simulate(TRUE)[0] + np.random.default_rng(seed).normal(0.0, sigma, 2 * len(TIMES))


def pymc_model(solve=None, data: np.ndarray | None = None):
    """The PyMC model: log-normal priors around the truth, Gaussian noise; ``solve`` maps
    the parameter vector to the trajectory (an Op; ``None``: the PyTensor version)."""
    import pymc as pm
    import pytensor.tensor as pt

    data = observed() if data is None else data
    with pm.Model() as model:
        theta = pm.LogNormal("theta", mu=np.log(TRUE), sigma=0.1, shape=4)
        sigma = pm.HalfNormal("sigma", 2.0)
        path = solve(theta) if solve is not None else lotka_volterra_pt(theta)
        pm.Normal("populations", mu=path, sigma=sigma, observed=data)
        pm.Deterministic("final_prey", pt.as_tensor_variable(path)[-2])
    return model
