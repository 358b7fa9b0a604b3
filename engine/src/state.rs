//! The state of one sequence between forward calls: for every layer a KV cache or a recurrent state (as
//! the architecture's [`StateSpec`]s say), and the tokens read so far.
//!
//! A [`SeqState`] is plain data and `Clone`: copying it forks a conversation or keeps a checkpoint. KV
//! caches grow with the sequence (rows of f32 per position) up to the context size fixed at creation;
//! recurrent states have a fixed size.
//!
//! A backend that keeps the state itself (the GPU) may leave the host's layers behind and attach a
//! [`Deferred`] that brings them up to date: the state's own methods that read or change the layers do so
//! first ([`SeqState::sync`]); [`SeqState::layer`] reads the host's copy as it is.
//!
//! Keys and values are stored as f32. By default they are first rounded to f16 precision
//! ([`KvPrecision::F16`]), which is what llama.cpp's default cache type keeps: on quantized models, whose
//! activation quantization turns small differences into rounding flips, this keeps results within
//! llama.cpp's own run-to-run spread. (Storing them as f16 to halve the memory comes with the memory work.)
//! [`KvPrecision::Q8_0`] (`--kv q8_0`) stores them as ggml Q8_0 blocks instead, 34 bytes for 32 values,
//! as llama.cpp's `-ctk q8_0 -ctv q8_0` does.

use poly_kernels::ops::attention;
use poly_models::arch::StateSpec;
use std::sync::Arc;

/// The newest part of a sequence's state, held outside its host layers by a backend that copies it back
/// only when the host needs it (the GPU: `crate::gpu::seq`).
pub trait DeferredState: Send + Sync {
    /// Brings `layers` up to date: the KV rows past those the host holds, the recurrent states.
    fn fetch_into(&self, layers: &mut [LayerState]) -> Result<(), String>;
    /// The present states of the recurrent layers among `layers` (`(layer, state)`), which stay as they
    /// are.
    fn recurrent_now(&self, layers: &[LayerState]) -> Result<Vec<(usize, RecurrentState)>, String>;
    /// Bytes the host layers will gain when brought up to date (the KV rows they lack).
    fn pending_bytes(&self) -> usize;
    /// The backend's own type (it may take its state back from it without the host's copy).
    fn as_any(&self) -> &dyn std::any::Any;
    /// The state cut to its first `n` positions (at or past those the host holds, KV layers only)
    /// without bringing it back, if the backend can; `None` has the caller bring it back first.
    fn truncated(&self, _n: usize) -> Option<Deferred> {
        None
    }
}

/// A state's [`DeferredState`]; copies of a state share it (equal when it is the same one).
#[derive(Clone)]
pub struct Deferred(pub Arc<dyn DeferredState>);

impl PartialEq for Deferred {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl std::fmt::Debug for Deferred {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Deferred")
    }
}

/// The precision keys and values keep in a KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum KvPrecision {
    /// As computed.
    F32,
    /// Rounded to f16 (llama.cpp's default cache type).
    #[default]
    F16,
    /// Stored as ggml Q8_0 blocks (32 values: an f16 scale and 32 signed bytes), quantized as llama.cpp's
    /// CPU backend stores a `q8_0` cache; head sizes must be multiples of 32.
    Q8_0,
}

impl KvPrecision {
    /// The name `--kv` takes.
    pub fn name(self) -> &'static str {
        match self {
            KvPrecision::F32 => "f32",
            KvPrecision::F16 => "f16",
            KvPrecision::Q8_0 => "q8_0",
        }
    }
}

/// Keys and values of every position of one layer, rows of `n_head_kv · head_dim` values per position:
/// f32 (rounded to f16 by default), or Q8_0 blocks ([`KvPrecision::Q8_0`]).
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
    /// The rows as Q8_0 blocks ([`KvPrecision::Q8_0`]; `k` and `v` stay empty).
    kq: Vec<u8>,
    vq: Vec<u8>,
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
            kq: Vec::new(),
            vq: Vec::new(),
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

    /// Bytes of a key row as Q8_0 blocks.
    fn k_row_q8(&self) -> usize {
        self.k_width() / 32 * 34
    }

    /// Bytes of a value row as Q8_0 blocks.
    fn v_row_q8(&self) -> usize {
        self.v_width() / 32 * 34
    }

    /// Positions stored.
    pub fn len(&self) -> usize {
        match self.precision {
            KvPrecision::Q8_0 => self.kq.len() / self.k_row_q8().max(1),
            _ => self.k.len() / self.k_width().max(1),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
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
            KvPrecision::Q8_0 => {
                assert!(
                    self.head_dim_k.is_multiple_of(32) && self.head_dim_v.is_multiple_of(32),
                    "KV cache: Q8_0 rows need head sizes that are multiples of 32"
                );
                attention::quantize_q8_0_rows(k, &mut self.kq);
                attention::quantize_q8_0_rows(v, &mut self.vq);
            }
        }
    }

    /// Appends rows given as f16 bits (what a GPU's cache holds; exact in either precision).
    pub fn append_f16(&mut self, k: &[u16], v: &[u16]) {
        use half::slice::HalfFloatSliceExt;
        let widen = |dst: &mut Vec<f32>, src: &[u16]| {
            let at = dst.len();
            dst.resize(at + src.len(), 0.0);
            let src: &[half::f16] = half::slice::HalfBitsSliceExt::reinterpret_cast(src);
            src.convert_to_f32_slice(&mut dst[at..]);
        };
        assert_eq!(
            k.len() / self.k_width().max(1) * self.v_width(),
            v.len(),
            "KV cache: keys and values differ in rows"
        );
        if self.precision == KvPrecision::Q8_0 {
            let (mut kf, mut vf) = (Vec::new(), Vec::new());
            widen(&mut kf, k);
            widen(&mut vf, v);
            self.append(&kf, &vf);
            return;
        }
        widen(&mut self.k, k);
        widen(&mut self.v, v);
    }

    /// Every key row, position 0 first (f32 and f16 caches; a Q8_0 cache has [`KvCache::keys_q8_0`]).
    pub fn keys(&self) -> &[f32] {
        self.assert_floats();
        &self.k
    }

    /// Every value row, position 0 first (f32 and f16 caches; a Q8_0 cache has
    /// [`KvCache::values_q8_0`]).
    pub fn values(&self) -> &[f32] {
        self.assert_floats();
        &self.v
    }

    fn assert_floats(&self) {
        assert_ne!(
            self.precision,
            KvPrecision::Q8_0,
            "KV cache: a Q8_0 cache's rows are blocks (keys_q8_0, values_q8_0)"
        );
    }

    /// Every key row of a Q8_0 cache as blocks, position 0 first (empty for other precisions).
    pub fn keys_q8_0(&self) -> &[u8] {
        &self.kq
    }

    /// Every value row of a Q8_0 cache as blocks, position 0 first (empty for other precisions).
    pub fn values_q8_0(&self) -> &[u8] {
        &self.vq
    }

    /// Keeps the first `n` positions.
    pub fn truncate(&mut self, n: usize) {
        self.k.truncate(n * self.k_width());
        self.v.truncate(n * self.v_width());
        self.kq.truncate(n * self.k_row_q8());
        self.vq.truncate(n * self.v_row_q8());
    }

    /// Bytes the rows hold.
    pub fn bytes(&self) -> usize {
        (self.k.len() + self.v.len()) * 4 + self.kq.len() + self.vq.len()
    }

    fn shrink_to_fit(&mut self) {
        self.k.shrink_to_fit();
        self.v.shrink_to_fit();
        self.kq.shrink_to_fit();
        self.vq.shrink_to_fit();
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

/// The recurrent layers' states of a sequence at one position: with the KV caches cut back to that
/// position, the sequence as it was there ([`SeqState::checkpoint`], [`SeqState::restore`]). A state
/// without recurrent layers needs none of it, so its checkpoints are free.
#[derive(Clone, Debug, PartialEq)]
pub struct Checkpoint {
    n_past: usize,
    recurrent: Vec<(usize, RecurrentState)>,
}

impl Checkpoint {
    /// Tokens the sequence had read when the checkpoint was taken.
    pub fn n_past(&self) -> usize {
        self.n_past
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.recurrent.iter().map(|(_, r)| r.bytes()).sum()
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
    /// Where the layers' newest part is when the host's copy is behind.
    deferred: Option<Deferred>,
    /// The trunk's hidden rows a draft block reads, when kept ([`SeqState::keep_hidden`]).
    hidden: Option<HiddenRows>,
    /// After each picture read under multi-section RoPE: the first cell after it and how many positions
    /// the cells from there lag behind their index (a picture's rows advance the positions by its span,
    /// not by its row count), cumulative, in order.
    picture_lags: Vec<(usize, u32)>,
    /// The cells each picture's rows took and the key of the picture ([`SeqState::key_last_picture`];
    /// 0 unless given), in order: what tells two pictures of the same size apart when a prompt is
    /// matched against the kept tokens, whose placeholders are the same.
    picture_marks: Vec<PictureMark>,
}

/// Where a picture's rows are in a sequence's cells and which picture it was.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PictureMark {
    pub start: usize,
    pub end: usize,
    pub key: u64,
}

/// The trunk's post-norm hidden rows of positions `from..from + data.len() / width`: what the model's
/// draft block reads with the token after each ([`poly_models::arch::Forward::forward_draft_block`]).
#[derive(Clone, Debug, PartialEq, Default)]
pub struct HiddenRows {
    from: usize,
    width: usize,
    data: Vec<f32>,
}

impl HiddenRows {
    fn end(&self) -> usize {
        self.from + self.data.len().checked_div(self.width).unwrap_or(0)
    }

    /// Drops the rows of positions `n` and after.
    fn cut(&mut self, n: usize) {
        let keep = n.saturating_sub(self.from).min(self.end() - self.from);
        self.data.truncate(keep * self.width);
    }
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
            deferred: None,
            hidden: None,
            picture_lags: Vec::new(),
            picture_marks: Vec::new(),
        }
    }

    /// Whether forward calls keep the trunk's hidden rows in this state for a draft block (off: none
    /// kept, and those kept are dropped).
    pub fn keep_hidden(&mut self, on: bool) {
        match on {
            true => {
                self.hidden.get_or_insert_with(HiddenRows::default);
            }
            false => self.hidden = None,
        }
    }

    /// Whether forward calls keep the trunk's hidden rows ([`SeqState::keep_hidden`]).
    pub fn keeps_hidden(&self) -> bool {
        self.hidden.is_some()
    }

    /// Keeps `rows` (`width` each) as the hidden rows of positions `pos0..`, replacing those kept from
    /// `pos0` on; rows kept before a gap or of another width are dropped. Nothing when not keeping.
    pub fn record_hidden(&mut self, pos0: usize, width: usize, rows: &[f32]) {
        let Some(h) = self.hidden.as_mut() else {
            return;
        };
        if width == 0 || h.width != width || pos0 < h.from || pos0 > h.end() {
            *h = HiddenRows {
                from: pos0,
                width,
                data: Vec::new(),
            };
        } else {
            h.cut(pos0);
        }
        h.data.extend_from_slice(rows);
    }

    /// The kept hidden row of position `pos`, if kept.
    pub fn hidden_row(&self, pos: usize) -> Option<&[f32]> {
        let h = self.hidden.as_ref()?;
        (pos >= h.from && pos < h.end())
            .then(|| &h.data[(pos - h.from) * h.width..(pos - h.from + 1) * h.width])
    }

    /// How many hidden rows are kept.
    pub fn hidden_rows_kept(&self) -> usize {
        self.hidden.as_ref().map_or(0, |h| h.end() - h.from)
    }

    /// Drops the kept hidden rows before position `pos` (a draft block has read them).
    pub fn forget_hidden_before(&mut self, pos: usize) {
        if let Some(h) = self.hidden.as_mut() {
            let n = pos.saturating_sub(h.from).min(h.end() - h.from);
            h.data.drain(..n * h.width);
            h.from += n;
        }
    }

    /// The RoPE position of cell `cell` when it holds text: its index less the lag of the pictures read
    /// before it ([`SeqState::record_picture`]).
    pub fn rope_position(&self, cell: usize) -> u32 {
        let lag = self
            .picture_lags
            .iter()
            .rev()
            .find(|&&(from, _)| from <= cell)
            .map_or(0, |&(_, lag)| lag);
        (cell as u32).saturating_sub(lag)
    }

    /// Cell `cell`'s four multi-section RoPE positions when it holds text: llama.cpp's `[p, p, p, 0]` at
    /// [`SeqState::rope_position`].
    pub fn text_rope_position(&self, cell: usize) -> [u32; 4] {
        let p = self.rope_position(cell);
        [p, p, p, 0]
    }

    /// Whether a picture was read under multi-section RoPE, so that positions and cells differ.
    pub fn has_pictures(&self) -> bool {
        !self.picture_lags.is_empty()
    }

    /// Records that the cells up to `end` ended with a picture of `n_rows` rows spanning `span` positions:
    /// the text from `end` on sits `n_rows - span` positions further behind its index.
    pub fn record_picture(&mut self, end: usize, n_rows: usize, span: usize) {
        let lag = self.picture_lags.last().map_or(0, |&(_, l)| l);
        let lag = lag + n_rows.saturating_sub(span) as u32;
        self.picture_lags.push((end, lag));
        self.picture_marks.push(PictureMark {
            start: end.saturating_sub(n_rows),
            end,
            key: 0,
        });
    }

    /// Records that the cells up to `end` ended with a picture of `n_rows` rows read at plain
    /// consecutive positions (Gemma 4), so that positions stay the cells: only its mark, which tells it
    /// from another picture of the same size.
    pub fn record_picture_in_line(&mut self, end: usize, n_rows: usize) {
        self.picture_marks.push(PictureMark {
            start: end.saturating_sub(n_rows),
            end,
            key: 0,
        });
    }

    /// Names the picture read last: `key` stands for its content (a hash of its file), so that a prompt
    /// with another picture in its place does not resume from this state past it.
    pub fn key_last_picture(&mut self, key: u64) {
        if let Some(m) = self.picture_marks.last_mut() {
            m.key = key;
        }
    }

    /// The pictures read, in order.
    pub fn picture_marks(&self) -> &[PictureMark] {
        &self.picture_marks
    }

    /// Forgets the pictures that ended after cell `n`.
    fn cut_pictures(&mut self, n: usize) {
        self.picture_lags.retain(|&(from, _)| from <= n);
        self.picture_marks.retain(|m| m.end <= n);
    }

    /// Drops the kept hidden rows of positions `n` and after (the state went back to `n` tokens).
    fn cut_hidden(&mut self, n: usize) {
        if let Some(h) = self.hidden.as_mut() {
            h.cut(n);
        }
    }

    /// The rotations around this state's KV caches: llama.cpp's for a Q8_0 cache (from the head sizes,
    /// when every attention layer has the same), none for f16 and f32 ones.
    pub fn kv_rotation(&self) -> attention::KvRotation {
        if self.precision != KvPrecision::Q8_0 {
            return attention::KvRotation::default();
        }
        let heads = |f: fn(&StateSpec) -> Option<usize>| {
            let mut sizes = self.specs.iter().filter_map(f);
            let first = sizes.next();
            sizes.all(|d| Some(d) == first).then_some(first).flatten()
        };
        attention::KvRotation::ggml(
            heads(|s| match *s {
                StateSpec::Kv { head_dim_k, .. } => Some(head_dim_k),
                StateSpec::Recurrent { .. } => None,
            }),
            heads(|s| match *s {
                StateSpec::Kv { head_dim_v, .. } => Some(head_dim_v),
                StateSpec::Recurrent { .. } => None,
            }),
        )
    }

    /// What brings the host's layers up to date, if they are behind.
    pub fn deferred(&self) -> Option<&Deferred> {
        self.deferred.as_ref()
    }

    /// Marks the host's layers as behind, `d` bringing them up to date (a backend's call, after it
    /// advanced the state it keeps).
    pub fn set_deferred(&mut self, d: Option<Deferred>) {
        self.deferred = d;
    }

    /// Brings the host's layers up to date (a no-op when they are). On an error (the backend lost the
    /// state) the layers stay behind and the mark is dropped.
    pub fn sync(&mut self) -> Result<(), String> {
        match self.deferred.take() {
            Some(d) => d.0.fetch_into(&mut self.layers),
            None => Ok(()),
        }
    }

    /// [`SeqState::sync`] for the methods that cannot return its error: it goes to stderr.
    fn sync_or_log(&mut self) {
        if let Err(e) = self.sync() {
            eprintln!("poly-engine: a sequence state could not be brought back to the host: {e}");
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

    /// The host's copy of layer `il` (behind while [`SeqState::deferred`] is set: [`SeqState::sync`]
    /// first).
    pub fn layer(&self, il: usize) -> &LayerState {
        &self.layers[il]
    }

    /// The state of layer `il`, to advance.
    pub fn layer_mut(&mut self, il: usize) -> &mut LayerState {
        self.sync_or_log();
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
        self.deferred = None;
        let precision = self.precision;
        self.layers = self
            .specs
            .iter()
            .map(|s| LayerState::new(s, precision))
            .collect();
        self.tokens.clear();
        self.cut_hidden(0);
        self.cut_pictures(0);
    }

    /// Whether a layer keeps a recurrent state (which cannot be rewound: going back needs a
    /// [`Checkpoint`]).
    pub fn has_recurrent(&self) -> bool {
        self.layers
            .iter()
            .any(|l| matches!(l, LayerState::Recurrent(_)))
    }

    /// Keeps the first `n` tokens. Only KV caches can be cut, so a state with recurrent layers can only
    /// be kept whole (`n == n_past`); returns whether the state now holds `n` tokens.
    pub fn truncate(&mut self, n: usize) -> bool {
        if n > self.n_past() || (n < self.n_past() && self.has_recurrent()) {
            return false;
        }
        if n == self.n_past() {
            return true;
        }
        // A backend holding the rows past the host's cuts its copy instead of bringing it back.
        self.cut_hidden(n);
        self.cut_pictures(n);
        if let Some(cut) = self.deferred.as_ref().and_then(|d| d.0.truncated(n)) {
            self.deferred = Some(cut);
            self.tokens.truncate(n);
            return true;
        }
        self.sync_or_log();
        for layer in &mut self.layers {
            if let LayerState::Kv(c) = layer {
                c.truncate(n);
            }
        }
        self.tokens.truncate(n);
        true
    }

    /// What going back to the present position needs later: the recurrent layers' states (KV caches
    /// are cut instead).
    pub fn checkpoint(&self) -> Checkpoint {
        if let Some(d) = &self.deferred {
            match d.0.recurrent_now(&self.layers) {
                Ok(recurrent) => {
                    return Checkpoint {
                        n_past: self.n_past(),
                        recurrent,
                    }
                }
                Err(e) => eprintln!("poly-engine: a checkpoint of the host's copy (behind): {e}"),
            }
        }
        Checkpoint {
            n_past: self.n_past(),
            recurrent: self
                .layers
                .iter()
                .enumerate()
                .filter_map(|(il, l)| match l {
                    LayerState::Recurrent(r) => Some((il, r.clone())),
                    LayerState::Kv(_) => None,
                })
                .collect(),
        }
    }

    /// Goes back to where `cp` was taken: cuts the KV caches and tokens to its position and puts back
    /// its recurrent states. `cp` must have been taken from this sequence at a position it has not gone
    /// back past since (the caller keeps that); returns false, changing nothing, when `cp` lies ahead or
    /// does not fit the layers.
    pub fn restore(&mut self, cp: &Checkpoint) -> bool {
        let fits = cp.n_past <= self.n_past()
            && cp.recurrent.iter().all(|(il, r)| {
                matches!(self.layers.get(*il), Some(LayerState::Recurrent(x))
                    if x.conv.len() == r.conv.len() && x.delta.len() == r.delta.len())
            })
            && self
                .layers
                .iter()
                .filter(|l| matches!(l, LayerState::Recurrent(_)))
                .count()
                == cp.recurrent.len();
        if !fits {
            return false;
        }
        self.sync_or_log();
        for (il, r) in &cp.recurrent {
            self.layers[*il] = LayerState::Recurrent(r.clone());
        }
        for layer in &mut self.layers {
            if let LayerState::Kv(c) = layer {
                c.truncate(cp.n_past);
            }
        }
        self.tokens.truncate(cp.n_past);
        self.cut_hidden(cp.n_past);
        self.cut_pictures(cp.n_past);
        true
    }

    /// Gives back memory the KV caches reserved beyond what they hold (before a state is parked). A
    /// state whose host layers are behind stays so: parking it copies nothing.
    pub fn shrink_to_fit(&mut self) {
        for layer in &mut self.layers {
            if let LayerState::Kv(c) = layer {
                c.shrink_to_fit();
            }
        }
        self.tokens.shrink_to_fit();
    }

    /// Bytes of state held (KV rows and recurrent states), counting those a backend holds for the host
    /// layers as the host will.
    pub fn bytes(&self) -> usize {
        self.deferred.as_ref().map_or(0, |d| d.0.pending_bytes())
            + self.hidden.as_ref().map_or(0, |h| h.data.len() * 4)
            + self
                .layers
                .iter()
                .map(|l| match l {
                    LayerState::Kv(c) => c.bytes(),
                    LayerState::Recurrent(r) => r.bytes(),
                })
                .sum::<usize>()
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

    #[test]
    fn checkpoints_bring_back_recurrent_layers_and_cut_kv_caches() {
        let kv = StateSpec::Kv {
            n_head_kv: 1,
            head_dim_k: 2,
            head_dim_v: 2,
            window: None,
        };
        let rec = StateSpec::Recurrent {
            conv_kernel: 2,
            conv_channels: 2,
            n_v_heads: 1,
            head_k: 1,
            head_v: 1,
        };
        let advance = |s: &mut SeqState, t: u32| {
            for il in 0..s.n_layers() {
                match s.layer_mut(il) {
                    LayerState::Kv(c) => c.append(&[t as f32; 2], &[t as f32; 2]),
                    LayerState::Recurrent(r) => r.delta[0] += t as f32,
                }
            }
            s.push_tokens(&[t]);
        };
        // KV only: cut anywhere, checkpoints cost nothing.
        let mut a = SeqState::with_precision(&[kv], 8, KvPrecision::F32);
        for t in 1..=4 {
            advance(&mut a, t);
        }
        assert!(!a.has_recurrent());
        assert_eq!(a.checkpoint().bytes(), 0);
        let mut cut = a.clone();
        assert!(cut.truncate(2));
        assert!(!cut.truncate(3), "cannot grow by cutting");
        let mut again = SeqState::with_precision(&[kv], 8, KvPrecision::F32);
        advance(&mut again, 1);
        advance(&mut again, 2);
        assert_eq!(cut, again);
        // Hybrid: only a checkpoint goes back.
        let mut h = SeqState::with_precision(&[kv, rec], 8, KvPrecision::F32);
        advance(&mut h, 1);
        advance(&mut h, 2);
        let at2 = h.checkpoint();
        let h2 = h.clone();
        assert_eq!(at2.n_past(), 2);
        assert_eq!(at2.bytes(), (2 + 1) * 4);
        advance(&mut h, 3);
        assert!(!h.truncate(2), "a recurrent layer cannot be cut");
        assert!(h.truncate(3));
        let ahead = h.checkpoint();
        assert!(h.restore(&at2));
        assert_eq!(h, h2);
        assert!(!h.restore(&ahead), "a checkpoint ahead of the state");
        assert_eq!(h, h2);
        assert!(!a.restore(&at2), "a checkpoint of other layers");
    }

    #[test]
    fn q8_0_caches_keep_blocks_of_34_bytes_for_32_values() {
        let kv = StateSpec::Kv {
            n_head_kv: 2,
            head_dim_k: 64,
            head_dim_v: 32,
            window: Some(4),
        };
        let rec = StateSpec::Recurrent {
            conv_kernel: 2,
            conv_channels: 2,
            n_v_heads: 1,
            head_k: 1,
            head_v: 1,
        };
        let mut s = SeqState::with_precision(&[kv, rec], 16, KvPrecision::Q8_0);
        let rows = |n: usize, w: usize, at: f32| -> Vec<f32> {
            (0..n * w).map(|i| ((i as f32 + at) * 0.37).sin()).collect()
        };
        let (k, v) = (rows(3, 128, 0.0), rows(3, 64, 1.0));
        let LayerState::Kv(c) = s.layer_mut(0) else {
            panic!("layer 0 is a KV cache")
        };
        c.append(&k[..128], &v[..64]);
        c.append(&k[128..], &v[64..]);
        assert_eq!(c.len(), 3);
        // Quantized row by row as a whole call would: ggml's blocks, 34 bytes for 32 values.
        let mut want_k = Vec::new();
        attention::quantize_q8_0_rows(&k, &mut want_k);
        assert_eq!(c.keys_q8_0(), &want_k[..]);
        assert_eq!(c.keys_q8_0().len(), 3 * 128 / 32 * 34);
        assert_eq!(c.values_q8_0().len(), 3 * 64 / 32 * 34);
        let mut back = vec![0f32; 64];
        poly_kernels::quant::dequantize(
            poly_kernels::quant::GgmlType::Q8_0,
            &c.values_q8_0()[2 * 68..],
            &mut back,
        )
        .unwrap();
        let err = back.iter().zip(&v[128..]).map(|(a, b)| (a - b).abs());
        assert!(
            err.fold(0f32, f32::max) <= 1.0 / 254.0 + 1e-6,
            "half a step of 1/127"
        );
        // The recurrent layer keeps f32; the KV rows 34/32 bytes a value.
        s.push_tokens(&[1, 2, 3]);
        assert_eq!(s.bytes(), 3 * (128 + 64) * 34 / 32 + (2 + 1) * 4);
        // Cut back: the first rows' blocks, as if the rest had never been read.
        let mut cut = s.clone();
        assert!(!cut.truncate(1), "a recurrent layer cannot be cut");
        let mut kv_only = SeqState::with_precision(&[kv], 16, KvPrecision::Q8_0);
        let LayerState::Kv(c) = kv_only.layer_mut(0) else {
            panic!("layer 0 is a KV cache")
        };
        c.append(&k, &v);
        kv_only.push_tokens(&[1, 2, 3]);
        let mut one = SeqState::with_precision(&[kv], 16, KvPrecision::Q8_0);
        let LayerState::Kv(c) = one.layer_mut(0) else {
            panic!("layer 0 is a KV cache")
        };
        c.append(&k[..128], &v[..64]);
        one.push_tokens(&[1]);
        assert!(kv_only.truncate(1));
        assert_eq!(kv_only, one);
        kv_only.clear();
        assert_eq!(kv_only.bytes(), 0);
        // f16 bits from a backend are quantized as they come.
        let LayerState::Kv(c) = kv_only.layer_mut(0) else {
            panic!("layer 0 is a KV cache")
        };
        let bits = |x: &[f32]| -> Vec<u16> {
            x.iter()
                .map(|&x| half::f16::from_f32(x).to_bits())
                .collect()
        };
        c.append_f16(&bits(&k[..128]), &bits(&v[..64]));
        let r16 = |x: &[f32]| -> Vec<f32> {
            x.iter().map(|&x| half::f16::from_f32(x).to_f32()).collect()
        };
        let mut want = Vec::new();
        attention::quantize_q8_0_rows(&r16(&k[..128]), &mut want);
        assert_eq!(c.keys_q8_0(), &want[..]);
    }

    #[test]
    #[should_panic(expected = "a Q8_0 cache's rows are blocks")]
    fn a_q8_0_cache_has_no_float_rows() {
        let kv = StateSpec::Kv {
            n_head_kv: 1,
            head_dim_k: 32,
            head_dim_v: 32,
            window: None,
        };
        let s = SeqState::with_precision(&[kv], 4, KvPrecision::Q8_0);
        let LayerState::Kv(c) = s.layer(0) else {
            panic!("layer 0 is a KV cache")
        };
        let _ = c.keys();
    }

    /// Stands in for a backend holding the newest rows: appends `rows` rows of ones to every KV layer.
    struct Behind {
        rows: usize,
    }

    impl DeferredState for Behind {
        fn fetch_into(&self, layers: &mut [LayerState]) -> Result<(), String> {
            for l in layers {
                if let LayerState::Kv(c) = l {
                    let (k, v) = (
                        vec![0x3c00u16; self.rows * c.k_width()],
                        vec![0x3c00u16; self.rows * c.v_width()],
                    );
                    c.append_f16(&k, &v);
                }
            }
            Ok(())
        }
        fn recurrent_now(&self, _: &[LayerState]) -> Result<Vec<(usize, RecurrentState)>, String> {
            Ok(Vec::new())
        }
        fn pending_bytes(&self) -> usize {
            self.rows * (8 + 6) * 4
        }
        fn as_any(&self) -> &dyn std::any::Any {
            self
        }
    }

    #[test]
    fn a_state_behind_counts_its_pending_rows_and_parks_without_fetching() {
        let kv = StateSpec::Kv {
            n_head_kv: 2,
            head_dim_k: 4,
            head_dim_v: 3,
            window: None,
        };
        let mut s = SeqState::with_precision(&[kv], 16, KvPrecision::F16);
        s.push_tokens(&[1, 2, 3]);
        s.set_deferred(Some(Deferred(Arc::new(Behind { rows: 3 }))));
        assert_eq!(s.bytes(), 3 * 14 * 4);
        s.shrink_to_fit();
        assert!(s.deferred().is_some(), "parking leaves the host behind");
        s.sync().unwrap();
        assert!(s.deferred().is_none());
        let LayerState::Kv(c) = s.layer(0) else {
            panic!("layer 0 is a KV cache")
        };
        assert_eq!(c.len(), 3);
        assert!(c.keys().iter().chain(c.values()).all(|&x| x == 1.0));
        assert_eq!(s.bytes(), 3 * 14 * 4);
        // f16 bits widen exactly, whatever the precision.
        let mut f = SeqState::with_precision(&[kv], 16, KvPrecision::F32);
        let LayerState::Kv(c) = f.layer_mut(0) else {
            panic!("layer 0 is a KV cache")
        };
        let bits: Vec<u16> = (0..8)
            .map(|i| half::f16::from_f32(0.1 * i as f32).to_bits())
            .collect();
        c.append_f16(&bits, &bits[..6]);
        assert_eq!(c.keys()[3], half::f16::from_f32(0.3).to_f32());
        assert_eq!(c.values().len(), 6);
    }

    #[test]
    fn hidden_rows_are_replaced_from_a_call_and_cut_with_the_state() {
        let spec = StateSpec::Kv {
            n_head_kv: 1,
            head_dim_k: 2,
            head_dim_v: 2,
            window: None,
        };
        let mut s = SeqState::new(&[spec], 16);
        s.record_hidden(0, 2, &[1.0, 1.0]);
        assert_eq!(s.hidden_rows_kept(), 0, "not kept unless asked");
        s.keep_hidden(true);
        s.record_hidden(0, 2, &[0.0, 0.0, 1.0, 1.0, 2.0, 2.0]);
        // A call from position 2 replaces rows from 2 on (a guess's row read again).
        s.record_hidden(2, 2, &[5.0, 5.0, 3.0, 3.0]);
        assert_eq!(s.hidden_row(2), Some(&[5.0, 5.0][..]));
        assert_eq!(s.hidden_row(3), Some(&[3.0, 3.0][..]));
        assert_eq!(s.hidden_rows_kept(), 4);
        s.forget_hidden_before(2);
        assert_eq!((s.hidden_row(1), s.hidden_rows_kept()), (None, 2));
        // A gap (rows before the call not kept) starts afresh at the call.
        s.record_hidden(7, 2, &[7.0, 7.0]);
        assert_eq!(
            (s.hidden_row(3), s.hidden_row(7)),
            (None, Some(&[7.0, 7.0][..]))
        );
        // Cutting the state cuts its rows.
        s.push_tokens(&[0; 8]);
        if let LayerState::Kv(c) = s.layer_mut(0) {
            c.append(&[0.0; 16], &[0.0; 16]);
        }
        assert!(s.truncate(7));
        assert_eq!(s.hidden_rows_kept(), 0);
        assert_eq!(s.bytes() % 4, 0);
        s.keep_hidden(false);
        assert!(!s.keeps_hidden());
    }
}
