//! The state of one sequence between forward calls: for every layer a KV cache or a recurrent state (as
//! the architecture's [`StateSpec`]s say), and the tokens read so far.
//!
//! A [`SeqState`] is plain data and `Clone`: copying it forks a conversation or keeps a checkpoint. KV
//! caches grow with the sequence (rows of f32 per position) up to the context size fixed at creation;
//! recurrent states have a fixed size.
//!
//! Keys and values are stored as f32. By default they are first rounded to f16 precision
//! ([`KvPrecision::F16`]), which is what llama.cpp's default cache type keeps: on quantized models, whose
//! activation quantization turns small differences into rounding flips, this keeps results within
//! llama.cpp's own run-to-run spread. (Storing them as f16 to halve the memory comes with the memory work.)

use poly_models::arch::StateSpec;

/// The precision keys and values keep in a KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum KvPrecision {
    /// As computed.
    F32,
    /// Rounded to f16 (llama.cpp's default cache type).
    #[default]
    F16,
}

/// Keys and values of every position of one layer, rows of `n_head_kv · head_dim` f32 per position.
#[derive(Clone, Debug, PartialEq)]
pub struct KvCache {
    pub n_head_kv: usize,
    pub head_dim_k: usize,
    pub head_dim_v: usize,
    /// Sliding window the layer attends over (it still keeps every position).
    pub window: Option<u32>,
    pub precision: KvPrecision,
    k: Vec<f32>,
    v: Vec<f32>,
}

impl KvCache {
    fn new(
        n_head_kv: usize,
        head_dim_k: usize,
        head_dim_v: usize,
        window: Option<u32>,
        precision: KvPrecision,
    ) -> Self {
        KvCache {
            n_head_kv,
            head_dim_k,
            head_dim_v,
            window,
            precision,
            k: Vec::new(),
            v: Vec::new(),
        }
    }

    /// Width of a key row.
    pub fn k_width(&self) -> usize {
        self.n_head_kv * self.head_dim_k
    }

    /// Width of a value row.
    pub fn v_width(&self) -> usize {
        self.n_head_kv * self.head_dim_v
    }

    /// Positions stored.
    pub fn len(&self) -> usize {
        self.k.len() / self.k_width().max(1)
    }

    pub fn is_empty(&self) -> bool {
        self.k.is_empty()
    }

    /// Appends the rows of `k` and `v` (whole rows, the same number of each).
    pub fn append(&mut self, k: &[f32], v: &[f32]) {
        assert_eq!(
            k.len() % self.k_width(),
            0,
            "KV cache: keys are not whole rows"
        );
        assert_eq!(
            k.len() / self.k_width() * self.v_width(),
            v.len(),
            "KV cache: keys and values differ in rows"
        );
        match self.precision {
            KvPrecision::F32 => {
                self.k.extend_from_slice(k);
                self.v.extend_from_slice(v);
            }
            KvPrecision::F16 => {
                let round = |x: &f32| half::f16::from_f32(*x).to_f32();
                self.k.extend(k.iter().map(round));
                self.v.extend(v.iter().map(round));
            }
        }
    }

    /// Every key row, position 0 first.
    pub fn keys(&self) -> &[f32] {
        &self.k
    }

    /// Every value row, position 0 first.
    pub fn values(&self) -> &[f32] {
        &self.v
    }

    /// Keeps the first `n` positions.
    pub fn truncate(&mut self, n: usize) {
        self.k.truncate(n * self.k_width());
        self.v.truncate(n * self.v_width());
    }

    fn bytes(&self) -> usize {
        (self.k.len() + self.v.len()) * 4
    }
}

/// The fixed-size state of a recurrent (gated delta-net) layer.
#[derive(Clone, Debug, PartialEq)]
pub struct RecurrentState {
    pub conv_kernel: usize,
    pub conv_channels: usize,
    pub n_v_heads: usize,
    pub head_k: usize,
    pub head_v: usize,
    /// The convolution's last `conv_kernel - 1` input rows of `conv_channels` values, oldest first.
    pub conv: Vec<f32>,
    /// The delta rule's matrices, `[n_v_heads][head_v][head_k]`.
    pub delta: Vec<f32>,
}

impl RecurrentState {
    fn bytes(&self) -> usize {
        (self.conv.len() + self.delta.len()) * 4
    }
}

/// The state of one layer.
#[derive(Clone, Debug, PartialEq)]
pub enum LayerState {
    Kv(KvCache),
    Recurrent(RecurrentState),
}

impl LayerState {
    /// An empty state of the given kind.
    pub fn new(spec: &StateSpec, precision: KvPrecision) -> LayerState {
        match *spec {
            StateSpec::Kv {
                n_head_kv,
                head_dim_k,
                head_dim_v,
                window,
            } => LayerState::Kv(KvCache::new(
                n_head_kv, head_dim_k, head_dim_v, window, precision,
            )),
            StateSpec::Recurrent {
                conv_kernel,
                conv_channels,
                n_v_heads,
                head_k,
                head_v,
            } => LayerState::Recurrent(RecurrentState {
                conv_kernel,
                conv_channels,
                n_v_heads,
                head_k,
                head_v,
                conv: vec![0.0; conv_kernel.saturating_sub(1) * conv_channels],
                delta: vec![0.0; n_v_heads * head_v * head_k],
            }),
        }
    }
}

/// Everything a model remembers of one sequence.
#[derive(Clone, Debug, PartialEq)]
pub struct SeqState {
    specs: Vec<StateSpec>,
    precision: KvPrecision,
    layers: Vec<LayerState>,
    tokens: Vec<u32>,
    n_ctx: usize,
}

impl SeqState {
    /// An empty sequence of at most `n_ctx` tokens for layers of the given kinds, its KV caches of the
    /// default precision.
    pub fn new(specs: &[StateSpec], n_ctx: usize) -> SeqState {
        SeqState::with_precision(specs, n_ctx, KvPrecision::default())
    }

    /// An empty sequence whose KV caches keep `precision`.
    pub fn with_precision(specs: &[StateSpec], n_ctx: usize, precision: KvPrecision) -> SeqState {
        SeqState {
            specs: specs.to_vec(),
            precision,
            layers: specs
                .iter()
                .map(|s| LayerState::new(s, precision))
                .collect(),
            tokens: Vec::new(),
            n_ctx,
        }
    }

    /// Tokens read so far (the position of the next one).
    pub fn n_past(&self) -> usize {
        self.tokens.len()
    }

    /// The tokens read so far.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Most tokens the sequence may hold.
    pub fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    /// Tokens that still fit.
    pub fn room(&self) -> usize {
        self.n_ctx.saturating_sub(self.tokens.len())
    }

    /// The state of layer `il`.
    pub fn layer(&self, il: usize) -> &LayerState {
        &self.layers[il]
    }

    /// The state of layer `il`, to advance.
    pub fn layer_mut(&mut self, il: usize) -> &mut LayerState {
        &mut self.layers[il]
    }

    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }

    /// Records tokens whose layers' states a forward call has just advanced.
    pub fn push_tokens(&mut self, tokens: &[u32]) {
        self.tokens.extend_from_slice(tokens);
    }

    /// Forgets everything: an empty sequence again.
    pub fn clear(&mut self) {
        let precision = self.precision;
        self.layers = self
            .specs
            .iter()
            .map(|s| LayerState::new(s, precision))
            .collect();
        self.tokens.clear();
    }

    /// Bytes of state held (KV rows and recurrent states).
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                LayerState::Kv(c) => c.bytes(),
                LayerState::Recurrent(r) => r.bytes(),
            })
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_follow_their_specs_and_clear() {
        let specs = [
            StateSpec::Kv {
                n_head_kv: 2,
                head_dim_k: 4,
                head_dim_v: 3,
                window: None,
            },
            StateSpec::Recurrent {
                conv_kernel: 4,
                conv_channels: 5,
                n_v_heads: 2,
                head_k: 3,
                head_v: 3,
            },
        ];
        let mut s = SeqState::with_precision(&specs, 10, KvPrecision::F32);
        let LayerState::Kv(kv) = s.layer_mut(0) else {
            panic!("layer 0 is a KV cache")
        };
        kv.append(&[1.0; 16], &[2.0; 12]);
        assert_eq!(kv.len(), 2);
        s.push_tokens(&[7, 8]);
        let LayerState::Recurrent(r) = s.layer(1) else {
            panic!("layer 1 is recurrent")
        };
        assert_eq!((r.conv.len(), r.delta.len()), (15, 18));
        assert_eq!(s.bytes(), (16 + 12 + 15 + 18) * 4);
        let fork = s.clone();
        s.clear();
        assert_eq!((s.n_past(), s.room()), (0, 10));
        assert_eq!(fork.n_past(), 2);
        assert_eq!(s, SeqState::with_precision(&specs, 10, KvPrecision::F32));
        // f16 precision rounds what is stored.
        let mut h = SeqState::new(&specs, 10);
        let LayerState::Kv(kv) = h.layer_mut(0) else {
            panic!("layer 0 is a KV cache")
        };
        kv.append(&[1.0 + 1e-4; 8], &[0.1; 6]);
        assert_eq!(kv.keys()[0], 1.0);
        assert_eq!(kv.values()[0], half::f16::from_f32(0.1).to_f32());
    }
}
