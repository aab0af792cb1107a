//! The CubeCL kernels: forward, dQ, and dK/dV. No Burn imports here.
//!
//! Tensors are contiguous `[N, H, T, Dh]` (index `((n·H + h)·T + t)·Dh + d`).
//! Every unit owns one row (a query row in forward and dQ, a key row in
//! dK/dV) and keeps it, and its accumulator, in registers; the cube loads
//! tiles of the other side into shared memory and walks them with an online
//! softmax. Arithmetic is f32 whatever the storage type. Key tiles whose keys
//! are all padding are skipped as a whole (the per-tile valid counts are
//! computed before launch), which is what makes a 200-of-1024 sample cost
//! ~200 keys.

use cubecl::prelude::*;

/// One round of a 32-bit integer mix (murmur3's finaliser).
#[cube]
fn mix(value: u32) -> u32 {
    let mut x = value;
    x ^= x >> 16;
    x *= 0x85eb_ca6bu32;
    x ^= x >> 13;
    x *= 0xc2b2_ae35u32;
    x ^= x >> 16;
    x
}

/// Whether attention probability `(bh, row, col)` survives dropout: a
/// counter-based hash, so forward and backward draw the same mask without
/// storing it. Kept when the hash is at least `threshold = p·2³²`.
#[cube]
fn dropout_keep(seed: u32, bh: u32, row: u32, col: u32, threshold: u32) -> bool {
    let x = mix(mix(mix(seed ^ bh) ^ row) ^ col);
    x >= threshold
}

/// Forward: `out = softmax(q·kᵀ·scale, masked)·v` and the row log-sum-exp.
///
/// Launch: cube (x: n·H + h − bh_offset, y: query block), units = query rows.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn attention_forward<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    key_valid: &Tensor<f32>,
    tile_valid: &Tensor<f32>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    scale: f32,
    heads: u32,
    bh_offset: u32,
    dropout_threshold: u32,
    dropout_scale: f32,
    seed: u32,
    #[comptime] head_dim: usize,
    #[comptime] tile_keys: usize,
    #[comptime] use_dropout: bool,
    #[comptime] unroll: bool,
    #[define(F)] _dtype: StorageType,
) {
    let tq = q.shape(2);
    let tk = k.shape(2);
    let bh = (CUBE_POS_X + bh_offset) as usize;
    let n = bh / heads as usize;
    let row = (CUBE_POS_Y * CUBE_DIM_X + UNIT_POS_X) as usize;
    let active = row < tq;
    let q_base = (bh * tq + row) * head_dim;
    let kv_base = bh * tk * head_dim;
    let n_tiles = tk.div_ceil(tile_keys);

    let mut q_row = Array::<f32>::new(head_dim);
    let mut acc = Array::<f32>::new(head_dim);
    #[unroll(unroll)]
    for d in 0..head_dim {
        q_row[d] = 0.0;
        acc[d] = 0.0;
    }
    if active {
        #[unroll(unroll)]
        for d in 0..head_dim {
            q_row[d] = f32::cast_from(q[q_base + d]) * scale;
        }
    }

    let mut k_tile = SharedMemory::<f32>::new(tile_keys * head_dim);
    let mut v_tile = SharedMemory::<f32>::new(tile_keys * head_dim);
    let mut valid_tile = SharedMemory::<f32>::new(tile_keys);
    let mut scores = Array::<f32>::new(tile_keys);

    let mut m = 0.0f32;
    let mut l = 0.0f32;
    let mut seen = false;

    for t in 0..n_tiles {
        // Uniform over the cube: every unit takes the same branch.
        if tile_valid[n * n_tiles + t] > 0.0 {
            load_tile::<F>(
                k,
                v,
                key_valid,
                &mut k_tile,
                &mut v_tile,
                &mut valid_tile,
                kv_base,
                n * tk,
                t * tile_keys,
                tk,
                head_dim,
                tile_keys,
            );
            sync_cube();
            if active {
                let mut tile_max = 0.0f32;
                let mut any = false;
                for jj in 0..tile_keys {
                    let mut s = 0.0f32;
                    if valid_tile[jj] > 0.0 {
                        #[unroll(unroll)]
                        for d in 0..head_dim {
                            s += q_row[d] * k_tile[jj * head_dim + d];
                        }
                        if !any || s > tile_max {
                            tile_max = s;
                        }
                        any = true;
                    }
                    scores[jj] = s;
                }
                if any {
                    let m_new = select(seen, f32::max(m, tile_max), tile_max);
                    let correction = select(seen, (m - m_new).exp(), 0.0f32);
                    l *= correction;
                    #[unroll(unroll)]
                    for d in 0..head_dim {
                        acc[d] *= correction;
                    }
                    for jj in 0..tile_keys {
                        if valid_tile[jj] > 0.0 {
                            let p = (scores[jj] - m_new).exp();
                            l += p;
                            let mut weight = p;
                            if use_dropout {
                                let col = (t * tile_keys + jj) as u32;
                                let keep = dropout_keep(
                                    seed,
                                    bh as u32,
                                    row as u32,
                                    col,
                                    dropout_threshold,
                                );
                                weight = select(keep, p * dropout_scale, 0.0f32);
                            }
                            #[unroll(unroll)]
                            for d in 0..head_dim {
                                acc[d] += weight * v_tile[jj * head_dim + d];
                            }
                        }
                    }
                    m = m_new;
                    seen = true;
                }
            }
            sync_cube();
        }
    }

    if active {
        let inv = select(seen, 1.0f32 / l, 0.0f32);
        #[unroll(unroll)]
        for d in 0..head_dim {
            out[q_base + d] = F::cast_from(acc[d] * inv);
        }
        lse[bh * tq + row] = select(seen, m + l.ln(), 0.0f32);
    }
}

/// Loads keys `[start, start + tile_keys)` of one (n, h) into shared memory,
/// with zeros past the end and the validity of each key.
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_tile<F: Float>(
    k: &Tensor<F>,
    v: &Tensor<F>,
    key_valid: &Tensor<f32>,
    k_tile: &mut SharedMemory<f32>,
    v_tile: &mut SharedMemory<f32>,
    valid_tile: &mut SharedMemory<f32>,
    kv_base: usize,
    valid_base: usize,
    start: usize,
    tk: usize,
    #[comptime] head_dim: usize,
    #[comptime] tile_keys: usize,
) {
    let mut idx = UNIT_POS_X as usize;
    while idx < tile_keys * head_dim {
        let j = start + idx / head_dim;
        let d = idx % head_dim;
        let mut kx = 0.0f32;
        let mut vx = 0.0f32;
        if j < tk {
            kx = f32::cast_from(k[kv_base + j * head_dim + d]);
            vx = f32::cast_from(v[kv_base + j * head_dim + d]);
        }
        k_tile[idx] = kx;
        v_tile[idx] = vx;
        idx += CUBE_DIM_X as usize;
    }
    let mut jj = UNIT_POS_X as usize;
    while jj < tile_keys {
        let j = start + jj;
        let mut valid = 0.0f32;
        if j < tk {
            valid = key_valid[valid_base + j];
        }
        valid_tile[jj] = valid;
        jj += CUBE_DIM_X as usize;
    }
}

/// Backward, query side: `dQ = scale · Σ_j P_ij (dP_ij − Δ_i) k_j`, with
/// `P` recomputed from the saved log-sum-exp and `Δ_i = rowsum(dO_i ⊙ O_i)`.
///
/// Launch: as [`attention_forward`].
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_dq<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    dout: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    key_valid: &Tensor<f32>,
    tile_valid: &Tensor<f32>,
    dq: &mut Tensor<F>,
    scale: f32,
    heads: u32,
    bh_offset: u32,
    dropout_threshold: u32,
    dropout_scale: f32,
    seed: u32,
    #[comptime] head_dim: usize,
    #[comptime] tile_keys: usize,
    #[comptime] use_dropout: bool,
    #[comptime] unroll: bool,
    #[define(F)] _dtype: StorageType,
) {
    let tq = q.shape(2);
    let tk = k.shape(2);
    let bh = (CUBE_POS_X + bh_offset) as usize;
    let n = bh / heads as usize;
    let row = (CUBE_POS_Y * CUBE_DIM_X + UNIT_POS_X) as usize;
    let active = row < tq;
    let q_base = (bh * tq + row) * head_dim;
    let kv_base = bh * tk * head_dim;
    let n_tiles = tk.div_ceil(tile_keys);

    let mut q_row = Array::<f32>::new(head_dim);
    let mut do_row = Array::<f32>::new(head_dim);
    let mut acc = Array::<f32>::new(head_dim);
    let mut row_lse = 0.0f32;
    let mut row_delta = 0.0f32;
    #[unroll(unroll)]
    for d in 0..head_dim {
        q_row[d] = 0.0;
        do_row[d] = 0.0;
        acc[d] = 0.0;
    }
    if active {
        #[unroll(unroll)]
        for d in 0..head_dim {
            q_row[d] = f32::cast_from(q[q_base + d]) * scale;
            do_row[d] = f32::cast_from(dout[q_base + d]);
        }
        row_lse = lse[bh * tq + row];
        row_delta = delta[bh * tq + row];
    }

    let mut k_tile = SharedMemory::<f32>::new(tile_keys * head_dim);
    let mut v_tile = SharedMemory::<f32>::new(tile_keys * head_dim);
    let mut valid_tile = SharedMemory::<f32>::new(tile_keys);

    for t in 0..n_tiles {
        if tile_valid[n * n_tiles + t] > 0.0 {
            load_tile::<F>(
                k,
                v,
                key_valid,
                &mut k_tile,
                &mut v_tile,
                &mut valid_tile,
                kv_base,
                n * tk,
                t * tile_keys,
                tk,
                head_dim,
                tile_keys,
            );
            sync_cube();
            if active {
                for jj in 0..tile_keys {
                    if valid_tile[jj] > 0.0 {
                        let mut s = 0.0f32;
                        let mut dp = 0.0f32;
                        #[unroll(unroll)]
                        for d in 0..head_dim {
                            s += q_row[d] * k_tile[jj * head_dim + d];
                            dp += do_row[d] * v_tile[jj * head_dim + d];
                        }
                        let p = (s - row_lse).exp();
                        if use_dropout {
                            let col = (t * tile_keys + jj) as u32;
                            let keep =
                                dropout_keep(seed, bh as u32, row as u32, col, dropout_threshold);
                            dp = select(keep, dp * dropout_scale, 0.0f32);
                        }
                        let ds = p * (dp - row_delta);
                        #[unroll(unroll)]
                        for d in 0..head_dim {
                            acc[d] += ds * k_tile[jj * head_dim + d];
                        }
                    }
                }
            }
            sync_cube();
        }
    }

    if active {
        #[unroll(unroll)]
        for d in 0..head_dim {
            dq[q_base + d] = F::cast_from(acc[d] * scale);
        }
    }
}

/// Backward, key side: `dV_j = Σ_i P̃_ij dO_i` and
/// `dK_j = scale · Σ_i P_ij (dP_ij − Δ_i) q_i` (P̃: after dropout). Masked
/// keys get zero gradients.
///
/// Launch: cube (x: n·H + h − bh_offset, y: key block), units = key rows.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_dkdv<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    dout: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    key_valid: &Tensor<f32>,
    dk: &mut Tensor<F>,
    dv: &mut Tensor<F>,
    scale: f32,
    heads: u32,
    bh_offset: u32,
    dropout_threshold: u32,
    dropout_scale: f32,
    seed: u32,
    #[comptime] head_dim: usize,
    #[comptime] tile_queries: usize,
    #[comptime] use_dropout: bool,
    #[comptime] unroll: bool,
    #[define(F)] _dtype: StorageType,
) {
    let tq = q.shape(2);
    let tk = k.shape(2);
    let bh = (CUBE_POS_X + bh_offset) as usize;
    let n = bh / heads as usize;
    let col = (CUBE_POS_Y * CUBE_DIM_X + UNIT_POS_X) as usize;
    let in_range = col < tk;
    let mut active = false;
    if in_range {
        active = key_valid[n * tk + col] > 0.0;
    }
    let k_base = (bh * tk + col) * head_dim;
    let q_base = bh * tq * head_dim;
    let n_tiles = tq.div_ceil(tile_queries);

    let mut k_row = Array::<f32>::new(head_dim);
    let mut v_row = Array::<f32>::new(head_dim);
    let mut dk_acc = Array::<f32>::new(head_dim);
    let mut dv_acc = Array::<f32>::new(head_dim);
    #[unroll(unroll)]
    for d in 0..head_dim {
        k_row[d] = 0.0;
        v_row[d] = 0.0;
        dk_acc[d] = 0.0;
        dv_acc[d] = 0.0;
    }
    if active {
        #[unroll(unroll)]
        for d in 0..head_dim {
            k_row[d] = f32::cast_from(k[k_base + d]);
            v_row[d] = f32::cast_from(v[k_base + d]);
        }
    }

    let mut q_tile = SharedMemory::<f32>::new(tile_queries * head_dim);
    let mut do_tile = SharedMemory::<f32>::new(tile_queries * head_dim);
    let mut lse_tile = SharedMemory::<f32>::new(tile_queries);
    let mut delta_tile = SharedMemory::<f32>::new(tile_queries);

    for t in 0..n_tiles {
        let start = t * tile_queries;
        let mut idx = UNIT_POS_X as usize;
        while idx < tile_queries * head_dim {
            let i = start + idx / head_dim;
            let d = idx % head_dim;
            let mut qx = 0.0f32;
            let mut dox = 0.0f32;
            if i < tq {
                qx = f32::cast_from(q[q_base + i * head_dim + d]) * scale;
                dox = f32::cast_from(dout[q_base + i * head_dim + d]);
            }
            q_tile[idx] = qx;
            do_tile[idx] = dox;
            idx += CUBE_DIM_X as usize;
        }
        let mut ii = UNIT_POS_X as usize;
        while ii < tile_queries {
            let i = start + ii;
            let mut lse_i = 0.0f32;
            let mut delta_i = 0.0f32;
            if i < tq {
                lse_i = lse[bh * tq + i];
                delta_i = delta[bh * tq + i];
            }
            lse_tile[ii] = lse_i;
            delta_tile[ii] = delta_i;
            ii += CUBE_DIM_X as usize;
        }
        sync_cube();
        if active {
            for ii in 0..tile_queries {
                let i = start + ii;
                if i < tq {
                    let mut s = 0.0f32;
                    let mut dp = 0.0f32;
                    #[unroll(unroll)]
                    for d in 0..head_dim {
                        s += q_tile[ii * head_dim + d] * k_row[d];
                        dp += do_tile[ii * head_dim + d] * v_row[d];
                    }
                    let p = (s - lse_tile[ii]).exp();
                    let mut p_kept = p;
                    if use_dropout {
                        let keep =
                            dropout_keep(seed, bh as u32, i as u32, col as u32, dropout_threshold);
                        p_kept = select(keep, p * dropout_scale, 0.0f32);
                        dp = select(keep, dp * dropout_scale, 0.0f32);
                    }
                    let ds = p * (dp - delta_tile[ii]);
                    #[unroll(unroll)]
                    for d in 0..head_dim {
                        dv_acc[d] += p_kept * do_tile[ii * head_dim + d];
                        dk_acc[d] += ds * q_tile[ii * head_dim + d];
                    }
                }
            }
        }
        sync_cube();
    }

    if in_range {
        #[unroll(unroll)]
        for d in 0..head_dim {
            dk[k_base + d] = F::cast_from(dk_acc[d]);
            dv[k_base + d] = F::cast_from(dv_acc[d]);
        }
    }
}
