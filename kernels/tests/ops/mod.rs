//! The one-op kernels' tests: Adam, attention pooling, the validated dense
//! products, GELU, LayerNorm, packed self-attention, seeded dropout, slot
//! unpacking. Run one file's tests with its path as the filter, e.g.
//! `cargo test -p aam-kernels --features wgpu,ndarray --test kernels ops::layer_norm::`.

mod adam_step;
mod attention_pool;
mod dense_validated_matmul;
mod gelu;
mod layer_norm;
mod packed_attention;
mod seeded_dropout;
mod unpack_rows;
