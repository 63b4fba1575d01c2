"""numba kernels: plain contiguous float64 arrays in, arrays out, log space, no validation.

Every kernel has a slow NumPy twin in ``_reference.py``; the tests compare the two. The public
wrappers in ``pools.py`` and ``sequence.py`` validate their arguments and mask out weight-0 teachers
before any of these run.
The vectorised exp / log and the soft backward step they build on are in ``jit.py``.
"""

import numpy as np
from numba import njit, prange

from .jit import FASTMATH as _FM
from .jit import exp_inplace, log_inplace, soft_value

@njit(cache=True)
def exp_kernel(x):
    """Vectorised exp of a 1-D array (the building block, exposed for its accuracy test)."""
    out = x.copy()
    a = np.empty(x.shape[0], np.int64)
    b = np.empty(x.shape[0], np.int64)
    exp_inplace(out, a, b)
    return out


@njit(cache=True)
def log_kernel(x):
    """Vectorised ln of a 1-D array of positive normal floats."""
    out = x.copy()
    b = np.empty(x.shape[0], np.int64)
    log_inplace(out, b)
    return out


# ----------------------------------------------------------------------------------- token pools

@njit(parallel=True, cache=True, fastmath=_FM)
def log_geometric_pool_kernel(log_probs, weights, out, log_z, status, n_chunks):
    """out[m] = s - ln Z, ln Z = log_z[m] = logsumexp(s), s = sum_k w_k log_probs[k, m]   (theory section 1).

    log_probs: (K, M, n), weights: (K,) all positive, out: (M, n), log_z: (M,), status: (M,) int8.
    n_chunks: the thread count; each thread owns a block of rows and its scratch rows.
    One read of the input. The status of each row is a by-product of that pass (a separate NumPy
    validation pass costs as much as the pool): 1 = some entry > 0 or NaN, 2 = empty support
    (every token -inf under some teacher). The wrapper raises on a non-zero status.
    """
    K, M, n = log_probs.shape
    chunks = min(n_chunks, max(M, 1))
    s_buf = np.empty((chunks, n))
    e_buf = np.empty((chunks, n))
    a_buf = np.empty((chunks, n), np.int64)
    b_buf = np.empty((chunks, n), np.int64)
    for c in prange(chunks):
        s = s_buf[c]
        e = e_buf[c]
        for m in range(c * M // chunks, (c + 1) * M // chunks):
            # s = sum_k w_k x_k, two teachers per pass over s; pos > 0 iff some entry is > 0
            pos = 0.0
            first = 2 - K % 2
            w0 = weights[0]
            if first == 1:
                for a in range(n):
                    x = log_probs[0, m, a]
                    pos += max(x, 0.0)
                    s[a] = w0 * x
            else:
                w1 = weights[1]
                for a in range(n):
                    x = log_probs[0, m, a]
                    y = log_probs[1, m, a]
                    pos += max(x, 0.0) + max(y, 0.0)
                    s[a] = w0 * x + w1 * y
            for k in range(first, K, 2):
                wk = weights[k]
                wl = weights[k + 1]
                for a in range(n):
                    x = log_probs[k, m, a]
                    y = log_probs[k + 1, m, a]
                    pos += max(x, 0.0) + max(y, 0.0)
                    s[a] += wk * x + wl * y
            # s <= 0, so exp(s) cannot overflow and no max-shift is needed unless the sum underflows
            nan_check = 0.0
            for a in range(n):
                e[a] = s[a]
                nan_check += s[a]
            if not (pos == 0.0) or nan_check != nan_check:
                status[m] = 1
                continue
            exp_inplace(e, a_buf[c], b_buf[c])
            tot = 0.0
            for a in range(n):
                tot += e[a]
            shift = 0.0
            if tot < 1e-280:
                shift = -np.inf
                for a in range(n):
                    shift = max(shift, s[a])
                if shift == -np.inf:
                    status[m] = 2
                    continue
                for a in range(n):
                    e[a] = s[a] - shift
                exp_inplace(e, a_buf[c], b_buf[c])
                tot = 0.0
                for a in range(n):
                    tot += e[a]
            status[m] = 0
            lse = shift + np.log(tot)
            log_z[m] = lse
            for a in range(n):
                out[m, a] = s[a] - lse


@njit(parallel=True, cache=True, fastmath=_FM)
def log_arithmetic_pool_kernel(log_probs, log_weights, out, status, n_chunks):
    """out[m, a] = logsumexp_k (ln w_k + log_probs[k, m, a])   (theory section 1).

    log_probs: (K, M, n), log_weights: (K,) finite, out: (M, n), status: (M,) int8 (1 = entry > 0
    or NaN). A streaming logsumexp over k keeps (max, sum) per token, so the first teacher costs no
    exp and each later one a single exp(-|d|): K - 1 exps per entry, then one vectorised log.
    """
    K, M, n = log_probs.shape
    chunks = min(n_chunks, max(M, 1))
    mx_buf = np.empty((chunks, n))
    sm_buf = np.empty((chunks, n))
    d_buf = np.empty((chunks, n))
    a_buf = np.empty((chunks, n), np.int64)
    b_buf = np.empty((chunks, n), np.int64)
    for c in prange(chunks):
        mx = mx_buf[c]
        sm = sm_buf[c]
        d = d_buf[c]
        for m in range(c * M // chunks, (c + 1) * M // chunks):
            pos = 0.0
            nan_check = 0.0     # NaN iff some entry is NaN (entries are <= 0 once pos == 0)
            lw = log_weights[0]
            for a in range(n):
                x = log_probs[0, m, a]
                pos += max(x, 0.0)
                nan_check += x
                mx[a] = lw + x
                sm[a] = 1.0
            for k in range(1, K):
                lw = log_weights[k]
                for a in range(n):
                    x = log_probs[k, m, a]
                    pos += max(x, 0.0)
                    nan_check += x
                    diff = (lw + x) - mx[a]
                    # both -inf: diff is NaN and the term is 0
                    d[a] = -abs(diff) if diff == diff else -np.inf
                exp_inplace(d, a_buf[c], b_buf[c])
                for a in range(n):
                    t = lw + log_probs[k, m, a]
                    up = t > mx[a]
                    sm[a] = sm[a] * d[a] + 1.0 if up else sm[a] + d[a]
                    mx[a] = t if up else mx[a]
            if not (pos == 0.0) or nan_check != nan_check:
                status[m] = 1
                continue
            status[m] = 0
            # sm >= 1, so the vectorised log applies
            log_inplace(sm, a_buf[c])
            for a in range(n):
                out[m, a] = mx[a] + sm[a]


# ------------------------------------------------------------------------- finite-state machines

@njit(parallel=True, cache=True)
def pooled_weights_kernel(log_probs, weights):
    """r[s, a] = sum_k w_k log_probs[k, s, a] (the per-token RKL reward, theory section 2); (K, S, n) -> (S, n)."""
    K, S, n = log_probs.shape
    r = np.empty((S, n))
    for s in prange(S):
        for a in range(n):
            acc = 0.0
            for k in range(K):
                acc += weights[k] * log_probs[k, s, a]
            r[s, a] = acc
    return r


@njit(parallel=True, cache=True)
def sequence_log_partition_linear_kernel(next_state, reward, horizon, out):
    """Backward recursion for ln Z in linear space with a per-step scale   (theory section 2).

    Z_h(s) = sum_a exp(r[s, a]) Z_{h+1}(next_state[s, a]), Z_H = 1, Z = 1 after an end (-1).
    exp(r) is taken once; each step is a gather and multiply-add, then the vector is divided by its
    maximum c_h and ln c_h accumulated, so out[h] = ln(scaled Z_h) + sum ln c.
    next_state: (S, n) int64, reward: (S, n) with every finite entry >= -700, out: (H + 1, S).
    Returns False when a state with a positive Z underflowed (its scaled value fell below 1e-280,
    or to 0 although some continuation has positive weight): out is then not valid and the caller
    falls back to the log-space kernel.
    """
    S, n = reward.shape
    weight = np.empty((S, n))
    nxt = np.empty((S, n), np.int64)
    for s in prange(S):
        for a in range(n):
            weight[s, a] = np.exp(reward[s, a])
            t = next_state[s, a]
            nxt[s, a] = S if t < 0 else t
    z = np.ones(S + 1)          # scaled Z_{h+1}; z[S] stands for "ended", true value 1
    z_new = np.empty(S + 1)
    log_scale = np.zeros(horizon + 1)
    out[horizon, :] = 1.0
    ok = True
    for h in range(horizon - 1, -1, -1):
        for s in prange(S):
            acc = 0.0
            for a in range(n):
                acc += weight[s, a] * z[nxt[s, a]]
            z_new[s] = acc
        c = 0.0
        for s in range(S):
            c = max(c, z_new[s])
        for s in range(S):
            v = z_new[s]
            if v == 0.0:
                for a in range(n):
                    t = nxt[s, a]
                    if reward[s, a] > -np.inf and (t == S or z[t] > 0.0):
                        ok = False
            elif v < 1e-280 * c:
                ok = False
        if not ok:
            break
        if c == 0.0:
            c = 1.0
        log_scale[h] = log_scale[h + 1] + np.log(c)
        for s in range(S):
            z[s] = z_new[s] / c
            out[h, s] = z[s]
        z[S] = np.exp(-log_scale[h])
    if ok:
        for h in prange(horizon + 1):
            for s in range(S):
                v = out[h, s]
                out[h, s] = np.log(v) + log_scale[h] if v > 0.0 else -np.inf
    return ok


@njit(parallel=True, cache=True)
def sequence_log_partition_log_kernel(next_state, reward, horizon, out):
    """The same recursion in log space: ln Z_h(s) = logsumexp_a (r[s, a] + ln Z_{h+1}(next))."""
    S = reward.shape[0]
    out[horizon, :] = 0.0
    for h in range(horizon - 1, -1, -1):
        for s in prange(S):
            out[h, s] = soft_value(next_state, reward, out[h + 1], s)


@njit(parallel=True, cache=True)
def geometric_conditionals_kernel(next_state, reward, log_partition, out):
    """ln g[h, s, a] = r[s, a] + ln Z_{h+1}(next) - ln Z_h(s); -inf where Z_h(s) = 0   (theory section 2)."""
    H, S, n = out.shape
    for hs in prange(H * S):
        h = hs // S
        s = hs % S
        lz = log_partition[h, s]
        for a in range(n):
            t = next_state[s, a]
            if lz == -np.inf:
                out[h, s, a] = -np.inf
            else:
                out[h, s, a] = reward[s, a] + (0.0 if t < 0 else log_partition[h + 1, t]) - lz


@njit(parallel=True, cache=True)
def sample_paths_kernel(next_state, cdf, table, step, start, uniforms, out):
    """Inverse-CDF sampling of token paths through the machine.

    cdf: (T, S, n) cumulative probabilities; sample i at step h uses table table[i] + step * h.
    uniforms: (N, H) in [0, 1); out: (N, H) int64 tokens, -1 after the response ends.
    """
    N, H = uniforms.shape
    n = cdf.shape[2]
    for i in prange(N):
        s = start
        for h in range(H):
            if s < 0:
                out[i, h] = -1
                continue
            row = cdf[table[i] + step * h, s]
            x = uniforms[i, h] * row[n - 1]
            a = 0
            while a < n - 1 and row[a] <= x:
                a += 1
            out[i, h] = a
            s = next_state[s, a]


@njit(cache=True)
def state_occupancy_kernel(next_state, probs, step, start, horizon, out):
    """Forward recursion: out[h + 1, next(s, a)] += out[h, s] P_h(a | s); out: (H + 1, S) zeroed.

    probs: (T, S, n); step 1 uses probs[h] at step h, step 0 uses probs[0] throughout.
    """
    S, n = next_state.shape
    out[0, start] = 1.0
    for h in range(horizon):
        p = probs[step * h]
        for s in range(S):
            o = out[h, s]
            if o == 0.0:
                continue
            for a in range(n):
                t = next_state[s, a]
                if t >= 0:
                    out[h + 1, t] += o * p[s, a]
