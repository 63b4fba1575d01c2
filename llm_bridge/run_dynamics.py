"""Where a distillation run goes: the fixed point of its expected update on finite-state teachers.

:func:`llm_bridge.runs.predict_target` names a run's target from the theory; this module computes where
the run goes for teachers given as a prefix-tree machine (aggregation's ``FiniteStateTeachers``, e.g.
``aggregation.examples.prefix_tree`` or a ``TabularLM``'s table), whether or not a closed form exists:
a data term beside the pool (Liger's hard loss, NeMo-RL's cross-entropy), clamps (verl), a discount
between 0 and 1 (tinker-cookbook), a task reward, a teacher chosen per micro-batch.

The model is a tabular student — one free softmax per state — trained by the run's *expected* update:
every response of the tree is a batch element, weighted by its probability under the run's sampler
(the student's rollouts at the sampling temperature, the routed teacher's traces, or the data set), with
the sampler held fixed during a step as a real sampler is. Each state's step is divided by how often the
run visits it (a positive per-state factor: the fixed points do not move). :func:`fixed_point` follows
that update from a start (uniform by default) until it stops, then solves for the exact root there, and
reports the distances (largest per-state total variation) to A, l, J_beta, g and each teacher.

    fp = fixed_point(VerlRun(defaults="dataclass", weights=(0.3, 0.7)), machine)
    fp.status, fp.nearest, fp.distances["A"]

:func:`expected_loss` builds the surrogate whose gradient is the expected update from *routes* (who
samples, which teachers score the samples) and a *loss* on the batch; tests/run_targets_harness.py
passes each library's own training-step code as that loss and checks that it stops where this module's
model of the run does.
"""

from dataclasses import dataclass, field

import numpy as np
import scipy.optimize
import torch

from llm_bridge import runs

# ------------------------------------------------------------------------------------------------
# the tree's responses as a batch
# ------------------------------------------------------------------------------------------------


@dataclass
class Batch:
    """Every response of a prefix-tree machine as one batch: ``states`` and ``tokens`` (P, H) with
    ``mask`` (P, H) (False past a response's end), the teachers' log-probs ``teacher_lp`` (K, S, n), the
    data's conditionals ``data_lp`` (S, n) and ``reward`` (P,) of each response."""
    states: torch.Tensor
    tokens: torch.Tensor
    mask: torch.Tensor
    teacher_lp: torch.Tensor
    data_lp: torch.Tensor
    reward: torch.Tensor
    S: int = 0
    n: int = 0
    student_lp: torch.Tensor = field(default=None)      # the student's current conditionals (detached), per step

    def path_log_probs(self, lp):
        """(P,) ln of each response's probability under conditionals ``lp`` (S, n)."""
        return (lp[self.states, self.tokens] * self.mask).sum(-1)


def batch_of(machine, data_log_probs=None, reward=None):
    """The :class:`Batch` of a prefix-tree machine (every root-to-leaf response, in lexicographic order).

    data_log_probs : (S, n) the data set's conditionals (default uniform: every response equally likely);
    reward : None (0), (P,) per response in that order, or a function of the response's tokens (a tuple)."""
    runs.prefix_depths(machine)                           # refuses a machine that is not a prefix tree
    nxt = machine.next_state
    S, n = nxt.shape
    paths = []

    def walk(s, states, tokens):
        for a in range(n):
            child = int(nxt[s, a])
            if child < 0:
                paths.append((states + [s], tokens + [a]))
            else:
                walk(child, states + [s], tokens + [a])
    walk(int(machine.start), [], [])
    H = max(len(t) for _, t in paths)
    states = torch.zeros(len(paths), H, dtype=torch.long)
    tokens = torch.zeros(len(paths), H, dtype=torch.long)
    mask = torch.zeros(len(paths), H, dtype=torch.float64)
    for i, (st, tk) in enumerate(paths):
        states[i, :len(st)], tokens[i, :len(tk)], mask[i, :len(tk)] = torch.tensor(st), torch.tensor(tk), 1.0
    if data_log_probs is None:
        data_lp = torch.full((S, n), -np.log(n), dtype=torch.float64)
    else:
        data_lp = torch.as_tensor(np.asarray(data_log_probs, dtype=float))
        if data_lp.shape != (S, n) or not torch.allclose(data_lp.exp().sum(-1), torch.ones(S, dtype=torch.float64)):
            raise ValueError(f"data_log_probs must be ({S}, {n}) log-probabilities, each row summing to 1")
    if reward is None:
        r = torch.zeros(len(paths), dtype=torch.float64)
    elif callable(reward):
        r = torch.tensor([float(reward(tuple(int(a) for a, m in zip(tk, mk) if m))) for tk, mk in zip(tokens, mask)],
                         dtype=torch.float64)
    else:
        r = torch.as_tensor(np.asarray(reward, dtype=float))
        if r.shape != (len(paths),):
            raise ValueError(f"reward has shape {tuple(r.shape)}: expected ({len(paths)},), one per response")
    if not torch.isfinite(r).all():
        raise ValueError("reward must be finite")
    return Batch(states, tokens, mask, torch.tensor(np.array(machine.log_probs, dtype=float)), data_lp, r, S, n)


# ------------------------------------------------------------------------------------------------
# routes: who samples the batch and which teachers score it
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Route:
    """A share ``weight`` of the run's samples drawn by ``sampler`` — ("student", tau), ("teacher", k, tau)
    or ("data",) — and scored against the teachers ``scored`` ((k, c_k), ...)."""
    weight: float
    sampler: tuple
    scored: tuple


def sampler_probs(route, batch):
    """(P,) each response's probability under the route's sampler (no gradient)."""
    kind = route.sampler[0]
    if kind == "data":
        lp = batch.data_lp
    else:
        table = batch.student_lp if kind == "student" else batch.teacher_lp[route.sampler[1]]
        tau = route.sampler[-1]
        lp = table if tau == 1.0 else torch.log_softmax(table / tau, -1)
    return batch.path_log_probs(lp).exp()


def routes_for(samples, teachers, weights, tau=1.0, lmbda=None):
    """The routes of a run: ``samples`` 'student', 'teacher' (each teacher's own traces), 'dataset', or
    'mixed:teacher' / 'mixed:dataset' with a share ``lmbda`` of the student's rollouts; ``teachers``
    'pooled' (every sample scored by all, weights w) or 'routed' (each sample scored by one k ~ w)."""
    ks = [k for k, wk in enumerate(weights) if wk > 0]

    def scored_by(k):
        return tuple((j, weights[j]) for j in ks) if teachers == "pooled" else ((k, 1.0),)

    def one(kind, share):
        if kind == "teacher":
            return [Route(share * weights[k], ("teacher", k, tau), scored_by(k)) for k in ks]
        sampler = ("student", tau) if kind == "student" else ("data",)
        if teachers == "pooled":
            return [Route(share, sampler, scored_by(None))]
        return [Route(share * weights[k], sampler, ((k, 1.0),)) for k in ks]
    if samples.startswith("mixed:"):
        return one("student", lmbda) + one(samples.split(":")[1], 1.0 - lmbda)
    return one(samples, 1.0)


def expected_loss(routes, loss, batch):
    """theta (S, n) -> the surrogate whose gradient is the run's expected update (each state's part divided
    by its visitation). ``loss(route, X, W, batch)``: the run's loss on the batch, X (P, H, n) the student's
    logits at every position, W (P, H) each position's weight (its sampler probability over the state's
    visitation; 0 past the end), returning sum W * per-position loss (or a surrogate with that gradient)."""
    def surrogate(theta):
        batch.student_lp = torch.log_softmax(theta.detach(), -1)
        probs = [sampler_probs(r, batch) for r in routes]
        visit = torch.zeros(batch.S, dtype=torch.float64)
        for r, p in zip(routes, probs):
            visit.index_add_(0, batch.states.reshape(-1), (r.weight * p[:, None] * batch.mask).reshape(-1))
        inverse = torch.where(visit > 0, 1.0 / visit.clamp_min(1e-300), torch.zeros_like(visit))
        X = theta[batch.states]
        total = theta.sum() * 0.0
        for r, p in zip(routes, probs):
            W = r.weight * p[:, None] * batch.mask * inverse[batch.states]
            total = total + loss(r, X, W, batch)
        return total
    return surrogate


def visited(routes, batch, student_lp):
    """(S,) bool: the states the run's samplers reach (the others are never trained)."""
    batch.student_lp = torch.as_tensor(student_lp)
    visit = torch.zeros(batch.S, dtype=torch.float64)
    for r in routes:
        p = sampler_probs(r, batch)
        visit.index_add_(0, batch.states.reshape(-1), (r.weight * p[:, None] * batch.mask).reshape(-1))
    return (visit > 0).numpy()


# ------------------------------------------------------------------------------------------------
# per-position losses of the run descriptions (this project's model of each library's step)
# ------------------------------------------------------------------------------------------------


def jsd_rows(lq, lp, beta):
    """JSD_beta(p, q) per row from log-probs: beta KL(p || m) + (1 - beta) KL(q || m), m = beta p + (1 - beta) q
    (beta = 0: KL(p || q), beta = 1: KL(q || p)); zero-probability entries contribute 0."""
    def kl(la, lb):
        return torch.where(la > -torch.inf, la.exp() * (la - lb), torch.zeros_like(la)).sum(-1)
    if beta == 0:
        return kl(lp, lq)
    if beta == 1:
        return kl(lq, lp)
    lm = torch.logaddexp(lp + np.log(beta), lq + np.log1p(-beta))
    return beta * kl(lp, lm) + (1 - beta) * kl(lq, lm)


def verl_kl_penalty(lq, lp, mode):
    """verl's kl_penalty_forward per token (the student's and the teacher's log-prob of the sampled token)."""
    if mode in ("kl", "k1"):
        return lq - lp
    if mode == "abs":
        return (lq - lp).abs()
    if mode in ("mse", "k2"):
        return 0.5 * (lq - lp) ** 2
    d = (lp - lq).clamp(-20, 20)                      # low_var_kl / k3, verl's stability clamps
    return (d.exp() - d - 1).clamp(-10, 10)


def k3(target_lp, lp):
    """exp(d) - 1 - d with d = target_lp - lp (torchrl's k3_kl_token_estimate, no clamp)."""
    d = target_lp - lp
    return d.exp() - 1 - d


def discounted_future_sum(x, gamma, mask):
    """sum_{j >= t} gamma^(j - t) x_j along the last axis, within each response."""
    out, running = torch.zeros_like(x), torch.zeros(x.shape[:-1], dtype=x.dtype)
    for t in range(x.shape[-1] - 1, -1, -1):
        running = (x[..., t] + gamma * running) * mask[..., t]
        out[..., t] = running
    return out


def _sampled(lq, batch):
    return lq.gather(-1, batch.tokens[..., None])[..., 0]


def _teacher(batch, k, tau=1.0):
    lp = batch.teacher_lp[k][batch.states]
    return lp if tau == 1.0 else torch.log_softmax(lp / tau, -1)


def _trl_loss(run):
    tau = run.loss_temperature

    def loss(route, X, W, batch):
        lq = torch.log_softmax(X / tau, -1)
        return sum(c * (W * jsd_rows(lq, _teacher(batch, k, tau), run.beta)).sum() for k, c in route.scored)
    return loss


def _liger_loss(run):
    def loss(route, X, W, batch):
        lq = torch.log_softmax(X / run.temperature, -1)
        soft = sum(c * jsd_rows(lq, _teacher(batch, k, run.temperature), run.beta) for k, c in route.scored)
        hard = -_sampled(torch.log_softmax(X, -1), batch)
        return (W * (run.weight_soft_loss * soft + run.weight_hard_loss * hard)).sum()
    return loss


def _verl_loss(run):
    def distillation_losses(lq, k, batch):
        if run.loss_mode == "forward_kl_topk":
            lp = _teacher(batch, k)
            ids = torch.topk(lp, min(run.topk, lp.shape[-1]), dim=-1).indices
            lq_k, lp_k = lq.gather(-1, ids), lp.gather(-1, ids)
            if run.log_prob_min_clamp is not None:
                lq_k, lp_k = lq_k.clamp_min(run.log_prob_min_clamp), lp_k.clamp_min(run.log_prob_min_clamp)
            value = (lp_k.exp() * (lp_k - lq_k)).sum(-1).clamp_min(0.0)
        else:
            value = verl_kl_penalty(_sampled(lq, batch), _sampled(_teacher(batch, k), batch), run.loss_mode)
        if run.loss_max_clamp is not None:
            value = value.clamp(-run.loss_max_clamp, run.loss_max_clamp)
        return value

    def loss(route, X, W, batch):
        lq = torch.log_softmax(X, -1)
        (k, _), = route.scored
        value = distillation_losses(lq, k, batch)
        if run.use_policy_gradient:               # advantage -value on the sampled token, PPO at ratio 1
            value = value.detach() * _sampled(lq, batch)
        total = (run.distillation_loss_coef if run.use_task_rewards else 1.0) * (W * value).sum()
        if run.use_task_rewards:                  # the task's policy gradient: advantage r - E_q r per token
            advantage = batch.reward - (sampler_probs(Route(1.0, ("student", 1.0), ()), batch) * batch.reward).sum()
            total = total - (W * advantage[:, None] * _sampled(lq, batch)).sum()
        return total
    return loss


def _torchrl_loss(run):
    def loss(route, X, W, batch):
        lq = _sampled(torch.log_softmax(X, -1), batch)
        (k, _), = route.scored
        lp = _sampled(_teacher(batch, k), batch)
        return (W * (k3(lp, lq) if run.kl_direction == "reverse" else k3(lq, lp))).sum()
    return loss


def _tinker_loss(run):
    """The per-token advantage -coef (ln q - sum_k c_k ln p_k) of the sampled token (one routed teacher, or
    the pooled log-ratio of this project's rkl_policy_gradient), discount-summed over the future."""
    def loss(route, X, W, batch):
        lq = _sampled(torch.log_softmax(X, -1), batch)
        teacher = sum(c * _sampled(_teacher(batch, k), batch) for k, c in route.scored)
        advantage = -run.kl_penalty_coef * (lq.detach() - teacher) * batch.mask
        if run.kl_discount_factor > 0:
            advantage = discounted_future_sum(advantage, run.kl_discount_factor, batch.mask)
        return -(W * advantage * lq).sum()
    return loss


def _micro_batches(run, P):
    """The responses of each micro-batch (contiguous, in the batch's order)."""
    count = P if run.micro_batches is None else min(run.micro_batches, P)
    return [torch.as_tensor(idx) for idx in np.array_split(np.arange(P), count)]


def _nemo_loss(run):
    def kl(lq, lp):
        return jsd_rows(lq, lp, 1.0 if run.reverse_kl else 0.0)

    def one_teacher(route, X, W, batch):
        lq = torch.log_softmax(X, -1)
        (k, _), = route.scored
        lp = _teacher(batch, k)
        forward, reverse = jsd_rows(lq, lp, 0.0), jsd_rows(lq, lp, 1.0)
        rows = {"forward": forward, "reverse": reverse,
                "mixed": run.mixed_kl_weight * forward + (1 - run.mixed_kl_weight) * reverse}[run.kl_type]
        return (W * rows).sum()

    def xtoken(route, X, W, batch):
        lq = torch.log_softmax(X, -1)
        ks = [k for k, _ in route.scored]
        w = [c for _, c in route.scored]
        ce_rows = -_sampled(lq, batch)
        data = batch.path_log_probs(batch.data_lp).exp()[:, None] * batch.mask     # each position's data weight
        total = X.sum() * 0.0
        for idx in _micro_batches(run, X.shape[0]):
            if run.kd_loss_mode == "sum":
                kd_rows = sum(w[i] * kl(lq[idx], _teacher(batch, k)[idx]) for i, k in enumerate(ks))
            elif run.kd_loss_mode == "averaged_logits":
                avg = sum(w[i] / sum(w) * _teacher(batch, k)[idx] for i, k in enumerate(ks))
                kd_rows = kl(lq[idx], torch.log_softmax(avg, -1))
            else:                                  # the teacher of lowest next-token CE on the micro-batch's tokens
                ces = [float(-(data[idx] * _sampled(_teacher(batch, k), batch)[idx]).sum()) for k in ks]
                kd_rows = kl(lq[idx], _teacher(batch, ks[int(np.argmin(ces))])[idx])
            kd, ce = (W[idx] * kd_rows).sum(), (W[idx] * ce_rows[idx]).sum()
            if run.dynamic_loss_scaling:           # sg(ce / kd) * kd + ce from the micro-batch's own sums
                kd_b = (data[idx] * kd_rows).sum().detach().abs()
                ce_b = (data[idx] * ce_rows[idx]).sum().detach().abs()
                total = total + (ce_b / kd_b if kd_b > 0 else 1.0) * kd + ce
            else:
                total = total + run.kl_loss_weight * kd + run.ce_loss_scale * ce
        return total
    return one_teacher if run.loss_fn == "DistillationLossFn" else xtoken


def _own_loss(run):
    from llm_bridge import losses
    if run.loss in ("forward_kl", "reverse_kl", "generalized_jsd"):
        beta = {"forward_kl": 0.0, "reverse_kl": 1.0}.get(run.loss, run.beta)

        def loss(route, X, W, batch):
            lq = torch.log_softmax(X, -1)
            return sum(c * (W * jsd_rows(lq, _teacher(batch, k), beta)).sum() for k, c in route.scored)
        return loss
    if run.loss == "rkl_policy_gradient":
        return _tinker_loss(runs.TinkerRun(kl_discount_factor=float(run.gamma)))

    def estimator_loss(route, X, W, batch):
        tokens = batch.tokens[..., None]
        P, H = tokens.shape[:2]
        teacher_lp = torch.stack([_teacher(batch, k).gather(-1, tokens) for k, _ in route.scored])    # (K', P, H, 1)
        w = torch.tensor([c for _, c in route.scored], dtype=torch.float64).expand(P * H, -1)
        value, _ = losses.kl_estimator_loss(X.reshape(P * H, 1, -1), tokens.reshape(P * H, 1),
                                            teacher_lp.reshape(len(route.scored), P * H, 1), w,
                                            estimator=run.estimator, mode=run.mode, pool=run.pool,
                                            direction=run.direction, reduction="none")
        return (W * value.reshape(P, H)).sum()
    return estimator_loss


def model_of(run):
    """(routes, loss) of this project's model of a run: who samples, who scores, the per-position loss."""
    w = tuple(run.weights)
    if isinstance(run, runs.TRLRun):
        return routes_for(run.samples, run.teachers, w, run.temperature, run.lmbda), _trl_loss(run)
    if isinstance(run, runs.LigerRun):
        return routes_for(run.samples, run.teachers, w), _liger_loss(run)
    if isinstance(run, runs.VerlRun):
        return routes_for("student", "routed", w), _verl_loss(run)
    if isinstance(run, runs.TorchRLRun):
        return routes_for(run.samples, "routed", w), _torchrl_loss(run)
    if isinstance(run, runs.TinkerRun):
        return routes_for("student", "routed", w), _tinker_loss(run)
    if isinstance(run, runs.NeMoRLRun):
        if run.loss_fn == "DistillationLossFn" and run.topk is not None:
            raise ValueError("NeMo-RL's DistillationLossFn with topk is not modelled here (topk=None only)")
        return routes_for(run.samples, "pooled", w), _nemo_loss(run)
    if isinstance(run, runs.OwnRun):
        return routes_for(run.samples, run.teachers, w), _own_loss(run)
    raise ValueError(f"run = {run!r} is not a run description")


# ------------------------------------------------------------------------------------------------
# following the update and solving for its fixed point
# ------------------------------------------------------------------------------------------------


def gradient_of(surrogate, S, n):
    """theta (S, n) numpy logits -> the expected update there (the gradient of ``surrogate``), as numpy."""
    def grad(theta_np):
        theta = torch.tensor(theta_np, dtype=torch.float64, requires_grad=True)
        g, = torch.autograd.grad(surrogate(theta), theta, allow_unused=True)
        return np.zeros((S, n)) if g is None else g.numpy()
    return grad


def follow(surrogate, start, steps=3000, tol=1e-10, patience=200):
    """Gradient steps on the expected update from ``start`` (S, n logits) until its largest entry is below
    ``tol``, stops falling (no tenfold fall in ``patience`` steps: a float32 library's rounding floor), or
    ``steps`` run out. The step grows by a quarter after each accepted step and halves whenever the update
    would grow by more than half (the run's learning rate does not move its fixed points). Returns the
    logits and the update's largest entry there."""
    grad = gradient_of(surrogate, *start.shape)
    theta = start - start.mean(-1, keepdims=True)
    g = grad(theta)
    size, lr = np.abs(g).max(), 1.0
    best, since = size, 0
    for _ in range(steps):
        if size < tol or since > patience:
            break
        trial = theta - lr * g
        trial -= trial.mean(-1, keepdims=True)
        g_trial = grad(trial)
        size_trial = np.abs(g_trial).max()
        since += 1
        if not np.isfinite(size_trial) or size_trial > 1.5 * size + 1e-12:
            lr /= 2
            if lr < 1e-12:
                break
            continue
        theta, g, size, lr = trial, g_trial, size_trial, min(1.25 * lr, 8.0)
        if size < best / 10:
            best, since = size, 0
    return theta, size


def polish(surrogate, theta, tol=1e-13):
    """A root of the expected update near ``theta`` (one logit per state pinned): (logits, largest entry)."""
    S, n = theta.shape
    grad = gradient_of(surrogate, S, n)

    def f(x):
        full = np.concatenate([x.reshape(S, n - 1), np.zeros((S, 1))], 1)
        return grad(full)[:, :-1].reshape(-1)
    x0 = (theta - theta[:, -1:])[:, :-1].reshape(-1)
    sol = scipy.optimize.root(f, x0, method="hybr", tol=tol)
    full = np.concatenate([sol.x.reshape(S, n - 1), np.zeros((S, 1))], 1)
    return full, float(np.abs(grad(full)).max())


def tv(log_a, log_b):
    """Per-state total variation (S,)."""
    return 0.5 * np.abs(np.exp(log_a) - np.exp(log_b)).sum(-1)


def log_softmax(theta):
    """Each row's log-probabilities (numpy)."""
    return theta - np.logaddexp.reduce(theta, axis=-1, keepdims=True)


@dataclass
class FixedPoint:
    """Where a run goes on a machine: ``log_probs`` (S, n) the student's conditionals there, ``status``
    ('fixed point': the update vanishes there; 'static': the update is zero everywhere, the student never
    moves; 'boundary': still moving, some probabilities towards 0; 'not converged'), ``residual`` (the
    update's largest entry there), ``distances`` (largest per-state total variation over the visited states
    to each named target and each teacher), ``nearest`` (the closest), ``prediction`` (predict_target's)
    and ``visited`` (S,) the states the run samples."""
    log_probs: np.ndarray
    status: str
    residual: float
    distances: dict
    nearest: str
    prediction: object
    visited: np.ndarray

    def summary(self):
        """One line: where the run goes, how far that is from the named targets."""
        near = ", ".join(f"{d:.3g} from {name}" for name, d in sorted(self.distances.items(), key=lambda x: x[1])[:3])
        return f"{self.status} ({self.prediction.label} predicted); {near}"


def named_targets(machine, weights, beta=0.5):
    """The named targets' conditionals on the machine: A, l (prior weights), J_beta, g, each teacher."""
    out = {}
    for target in ("A", "l", "J"):
        p = runs.Prediction(target, beta=beta)
        name = f"J_{beta:g}" if target == "J" else target
        if target == "J" and sum(1 for w in weights if w > 0) < 2:
            continue
        out[name] = runs.target_log_probs(p, machine, weights)
    out["g"] = runs.target_log_probs(runs.Prediction("g", level="sequence"), machine, weights)
    for k, wk in enumerate(weights):
        if wk > 0:
            out[f"teacher {k + 1}"] = np.asarray(machine.log_probs[k], dtype=float)
    return out


def settle(surrogate, theta, steps=3000, tol=1e-10):
    """Steps of size 1 / sqrt(1 + t / 10) (a diminishing step: on an update that jumps, as a clamp or |.|'s
    sign makes it, the run enters the set where the update is exactly 0 instead of circling its edge).
    Returns the logits and the update's largest entry there."""
    grad = gradient_of(surrogate, *theta.shape)
    g = grad(theta)
    for t in range(steps):
        if np.abs(g).max() < tol:
            break
        theta = theta - g / np.sqrt(1 + t / 10)
        theta -= theta.mean(-1, keepdims=True)
        g = grad(theta)
    return theta, float(np.abs(g).max())


def solve(surrogate, theta0, steps=3000):
    """(logits, residual, status) where the expected update from ``theta0`` goes (see :class:`FixedPoint`):
    adaptive steps (:func:`follow`), then, if the update has not vanished, diminishing steps
    (:func:`settle`), then the exact root near the end point (:func:`polish`)."""
    S, n = theta0.shape
    grad = gradient_of(surrogate, S, n)
    rng = np.random.default_rng(0)
    if all(np.abs(grad(theta0 + rng.normal(size=(S, n)))).max() < 1e-12 for _ in range(2)):
        return theta0, 0.0, "static"
    theta, residual = follow(surrogate, theta0, steps=steps, tol=1e-10)
    if residual >= 1e-6:
        theta, residual = settle(surrogate, theta, steps=steps)
    if residual >= 1e-12:                     # the exact root near where the update stopped
        polished, res = polish(surrogate, theta)
        if res < residual and tv(log_softmax(polished), log_softmax(theta)).max() < 0.05:
            theta, residual = polished, res
    if residual < 1e-6:
        return theta, residual, "fixed point"
    return theta, residual, "boundary" if np.exp(log_softmax(theta)).min() < 1e-6 else "not converged"


def fixed_point(run, machine, data_log_probs=None, reward=None, start=None, steps=3000):
    """Where ``run`` goes on the teachers of a prefix-tree ``machine`` (K = len(run.weights) teachers):
    a :class:`FixedPoint`. data_log_probs : (S, n) the data set's conditionals (runs that train on a data
    set; default uniform); reward : the task reward per response (verl's use_task_rewards; default 0);
    start : (S, n) the student's starting log-probs (default uniform)."""
    if len(run.weights) != machine.log_probs.shape[0]:
        raise ValueError(f"run.weights has {len(run.weights)} teachers, the machine {machine.log_probs.shape[0]}")
    batch = batch_of(machine, data_log_probs, reward)
    routes, loss = model_of(run)
    surrogate = expected_loss(routes, loss, batch)
    S, n = batch.S, batch.n
    theta0 = np.zeros((S, n)) if start is None else np.array(start, dtype=float)
    if theta0.shape != (S, n) or not np.isfinite(theta0).all():
        raise ValueError(f"start must be finite ({S}, {n}) log-probabilities")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                  # tiny tensors: more threads only add overhead
    try:
        theta, residual, status = solve(surrogate, theta0, steps)
    finally:
        torch.set_num_threads(threads)
    log_q = log_softmax(theta)
    reached = visited(routes, batch, log_q)
    beta = getattr(run, "beta", None)
    targets = named_targets(machine, run.weights, 0.5 if beta is None or beta in (0.0, 1.0) else beta)
    distances = {name: float(tv(log_q, lp)[reached].max()) for name, lp in targets.items()}
    return FixedPoint(log_q, status, float(residual), distances, min(distances, key=distances.get),
                      runs.predict_target(run), reached)


# ------------------------------------------------------------------------------------------------
# a prefix-tree machine of real teachers (the diagnosis's --run)
# ------------------------------------------------------------------------------------------------


@dataclass
class TeacherTree:
    """A prefix-tree machine cut from real teachers: ``machine`` (FiniteStateTeachers, each teacher's
    conditionals restricted to the tree's tokens and renormalised), ``token_ids`` (S, width) the vocabulary
    ids of each state's tokens, ``mass`` (K, S) the share of each teacher's conditional those tokens hold."""
    machine: object
    token_ids: np.ndarray
    mass: np.ndarray


def teacher_tree(teachers, prompt_ids, weights, width=3, depth=3):
    """The ``width`` most probable tokens of the teachers' mixture (weights ``weights``) after the prompt, then
    after each of them, to ``depth`` tokens: a prefix tree of (width^depth - 1) / (width - 1) states whose
    conditionals are each teacher's next-token distribution there restricted to those tokens (renormalised).
    ``teachers``: an :class:`llm_bridge.Teachers` (teacher_log_probs with full conditionals)."""
    from aggregation import FiniteStateTeachers
    if width < 2 or depth < 1:
        raise ValueError(f"width = {width!r} must be >= 2 and depth = {depth!r} >= 1")
    w = np.asarray(weights, dtype=float)
    states, nxt, rows, ids, mass = [()], [], [], [], []
    for prefix in states:                                   # breadth first: the list grows as it is read
        if len(prefix) == depth:
            break
        _, full = teachers.teacher_log_probs(prompt_ids, list(prefix) + [0], full=True)
        lp = full[:, len(prefix)]                           # (K, n) after the prefix
        with np.errstate(divide="ignore"):
            mixture = np.logaddexp.reduce(np.log(w)[:, None] + lp, axis=0)
        top = np.argsort(-mixture, kind="stable")[:width]
        part = lp[:, top]
        rows.append(part - np.logaddexp.reduce(part, axis=-1, keepdims=True))
        mass.append(np.exp(np.logaddexp.reduce(part, axis=-1)))
        ids.append(top)
        children = []
        for a in top:
            if len(prefix) + 1 < depth:
                children.append(len(states))
                states.append(prefix + (int(a),))
            else:
                children.append(-1)
        nxt.append(children)
    machine = FiniteStateTeachers(np.asarray(nxt, dtype=np.int64), np.stack(rows, axis=1), 0)
    return TeacherTree(machine, np.asarray(ids), np.stack(mass, axis=1))


def where_on_teachers(run, teachers, prompt_ids, width=3, depth=3):
    """:func:`fixed_point` of ``run`` on :func:`teacher_tree` of real teachers: (FixedPoint, TeacherTree)."""
    tree = teacher_tree(teachers, prompt_ids, run.weights, width, depth)
    return fixed_point(run, tree.machine), tree
