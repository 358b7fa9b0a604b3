//! The MoE layer of a forward call on the card: routing, the expert cache's share (staged or on the CPU),
//! the card's experts (grouped by expert for a prompt on the tensor cores, slot by slot for one token) and
//! their weighted sum.

use super::fused::{fuse_on, Fusion};
use super::*;
use poly_kernels::cuda::ops::Tickets;

/// The card's routed-expert outputs before they are summed per token.
pub(super) enum CardExperts {
    /// `[slots, n_embd]` in expert order, with the grouping that sums them back.
    Grouped(DeviceBuffer<f32>, ExpertGroups),
    /// `[slots, n_embd]` in slot order.
    Slots(DeviceBuffer<f32>),
    /// Already summed into the layer's output by the down experts' launch.
    Summed,
}

/// What [`GpuForward::moe_leaving`] leaves to its caller besides the output it wrote.
pub(super) enum MoeLeft {
    /// The output is whole.
    Nothing,
    /// A segmented step's shared expert output, for the caller to add.
    Shared(DevAct),
    /// One token's slot outputs `[k, n_embd]` and their weights `[k]`, unsummed: the output is unwritten.
    Slots {
        y: DeviceBuffer<f32>,
        weights: DeviceBuffer<f32>,
    },
}

/// Where one token's down experts sum their slots in their own launch: the weights `[k]` and the layer's
/// output, overwritten.
pub(super) type SlotSumInto<'b> = (&'b DeviceBuffer<f32>, &'b mut DeviceBuffer<f32>);

pub(super) struct ExpertGroups {
    /// `[slots]` the token of each sorted row.
    rows: DeviceBuffer<i32>,
    /// `[slots]` the sorted row of each (token, choice).
    slot_row: DeviceBuffer<i32>,
    /// `[n_tiles·3]` (expert, first row, rows) tiles of at most `tile_rows` rows, padded with empty ones.
    tiles: DeviceBuffer<i32>,
    tile_rows: usize,
}

impl ExpertGroups {
    fn give_back(self, pool: &Pool) {
        pool.put_i32(self.rows);
        pool.put_i32(self.slot_row);
        pool.put_i32(self.tiles);
    }
}

impl<'a> GpuForward<'a> {
    /// The experts of `w` as the kernels see them.
    pub(super) fn table(&self, w: WeightId) -> CudaResult<&'a ExpertTable> {
        match self.weights.matrix(w)? {
            GpuWeight::Experts(s) => Ok(s.table()),
            _ => Err(CudaError::Invalid(format!(
                "weight {} is not an expert tensor",
                w.0
            ))),
        }
    }

    /// `y = W[ids[s]]·x_s` for every slot, quantizing `x` first when the experts are quantized.
    /// `x_id` names a one-row input shared by several expert tensors (quantized once).
    pub(super) fn experts_mul(
        &self,
        table: &ExpertTable,
        ids: &DeviceBuffer<i32>,
        (x, x_id): (&DeviceBuffer<f32>, Option<u64>),
        input: ExpertInput,
        y: &mut DeviceBuffer<f32>,
    ) -> CudaResult<()> {
        match ops::activation_form(table.ty) {
            Some(ops::ActivationForm::Q8_1) => self.with_q8(x_id, x, |xq| {
                ops::matvec_experts_q(self.dev, table, ids, xq, input, y)
            }),
            _ => ops::matvec_experts_f(self.dev, table, ids, x, input, y),
        }
    }

    /// The cache's layer of `m` when this call hands it over to the host as a segmented graph's step.
    pub(super) fn segmented_layer(&self, m: &Moe) -> Option<usize> {
        let layer = self.experts.as_deref()?.layer_of(m.gate_exps)?;
        self.graph
            .as_ref()
            .is_some_and(|g| g.segmented)
            .then_some(layer)
    }

    /// `m` on `x` into `out`; with `shared`, a segmented step computes the shared expert while the host
    /// decides and returns it (the caller adds it), else the caller computes it.
    pub(super) fn moe_into(
        &mut self,
        x: &DevAct,
        m: &Moe,
        shared: Option<&SharedExpert>,
        out: &mut DevAct,
    ) -> CudaResult<Option<DevAct>> {
        match self.moe_leaving(x, (m, shared), out, false)? {
            MoeLeft::Shared(s) => Ok(Some(s)),
            MoeLeft::Nothing => Ok(None),
            MoeLeft::Slots { y, weights } => {
                // Not asked for: sum them as the layer would have.
                let k = m.n_expert_used;
                let r = ops::moe_combine(self.dev, &y, &weights, k, false, out.buf_mut()?);
                self.pool.put_f32(y);
                self.pool.put_f32(weights);
                r.map(|()| None)
            }
        }
    }

    /// [`Self::moe_into`] without the last launch where it can: with `leave_slots`, one token whose
    /// experts the card computes whole (no CPU share, not grouped, not a segmented step) leaves its slot
    /// outputs and weights unsummed ([`MoeLeft::Slots`]) and `out` unwritten, for a launch that sums them
    /// with what follows (`moe_add_rms_norm`).
    pub(super) fn moe_leaving(
        &mut self,
        x: &DevAct,
        (m, shared): (&Moe, Option<&SharedExpert>),
        out: &mut DevAct,
        leave_slots: bool,
    ) -> CudaResult<MoeLeft> {
        let dev = self.dev;
        let (n, k) = (x.rows, m.n_expert_used);
        if m.selection_bias.is_some() {
            return Err(CudaError::Invalid(
                "the card does not route with an expert selection bias (exp_probs_b) yet".into(),
            ));
        }
        let slots = n * k;
        if slots > MAX_SLOTS {
            return Err(CudaError::Invalid(format!(
                "{n} tokens × {k} experts in one call"
            )));
        }
        if let Some(layer) = self.segmented_layer(m) {
            return Ok(match self.moe_segmented(x, m, (layer, shared), out)? {
                Some(s) => MoeLeft::Shared(s),
                None => MoeLeft::Nothing,
            });
        }
        let cached = self
            .experts
            .as_deref()
            .and_then(|c| c.layer_of(m.gate_exps));
        // Router logits [n, n_expert], then ids and weights [n, k] on the card; a single token's leaning to
        // the cached experts (`--cache-bias`), and which choices it made where the host reads the routing
        // (not from the mapped file: such a token needs no host).
        let mut ids = self.pool.i32(dev, slots)?;
        let mut weights = self.pool.f32(dev, slots)?;
        let bias = self.cache_bias(m, n);
        let counted = bias.is_some() && !self.experts.as_deref().is_some_and(|c| c.reads_mapped());
        let mut changed = match counted {
            true => Some(self.pool.i32(dev, 1)?),
            false => None,
        };
        let selection = bias.map(|(bias, offset)| ops::SelectionBias {
            bias,
            offset,
            changed: changed.as_mut(),
        });
        let routed = self.route(x, m, (&mut ids, &mut weights), selection);
        let changed_bits = match (&routed, &changed) {
            (Ok(()), Some(c)) => dev.download(c).map(|v| v.first().map_or(0, |&b| b as u32)),
            _ => Ok(0),
        };
        if let Some(c) = changed {
            self.pool.put_i32(c);
        }
        routed?;
        let changed_bits = changed_bits?;
        // Experts the cache lacks: staged for a prompt, the CPU's share for one token.
        let cpu_share = match (cached, self.experts.as_deref_mut()) {
            // A single token whose missing experts the kernels read from the mapped file needs nothing.
            (Some(layer), Some(cache))
                if !cache.holds_all() && (n > 1 || !cache.reads_mapped()) =>
            {
                let host_ids = dev.download(&ids)?;
                let fetch = || Ok((dev.download(x.buf()?)?, dev.download(&weights)?));
                let routing = (host_ids.as_slice(), changed_bits);
                cache.prepare(dev, self.cpu, (layer, n), routing, fetch)?
            }
            (Some(_), Some(cache)) => {
                // A capture is not a token (its replays are counted by the backend); experts read from
                // the mapped file are not counted at all (a graph cannot tell which were).
                if !self.graph.as_ref().is_some_and(|g| g.capturing) && cache.holds_all() {
                    cache.count_all_vram(slots);
                }
                // The launches below read the layer's tables.
                cache.flush_deferred(dev)?;
                None
            }
            _ => None,
        };
        let card_computes = !cpu_share.as_ref().is_some_and(|s| s.all);
        let r = if card_computes {
            let routing = (&ids, &weights);
            let share = (cached, cpu_share.as_ref(), leave_slots);
            self.moe_card_and_cpu(x, routing, m, share, out)
        } else if let Some(share) = &cpu_share {
            let sum = share.compute_for(self.experts.as_deref_mut(), self.cpu, m);
            out.buf_mut()
                .and_then(|o| dev.write(&sum, o))
                .map(|()| None)
        } else {
            Ok(None)
        };
        let finished = match (cached, self.experts.as_deref_mut()) {
            (Some(layer), Some(cache)) => cache.finish_layer(dev, self.cpu, layer),
            _ => Ok(()),
        };
        self.pool.put_i32(ids);
        match (r, finished) {
            (Ok(Some(y)), Ok(())) => Ok(MoeLeft::Slots { y, weights }),
            (r, finished) => {
                self.pool.put_f32(weights);
                let r = r.map(|left| {
                    if let Some(y) = left {
                        self.pool.put_f32(y);
                    }
                });
                finished?;
                r.map(|()| MoeLeft::Nothing)
            }
        }
    }

    /// `--cache-bias`'s vector for `m`'s router in a call of `rows` tokens: a single token's on a cache
    /// that lacks experts ([`ExpertCache::selection_bias`]); else none (the routers as without the flag).
    fn cache_bias(&self, m: &Moe, rows: usize) -> Option<(&DeviceBuffer<f32>, usize)> {
        let cache = self.experts.as_deref().filter(|_| rows == 1)?;
        cache.selection_bias(cache.layer_of(m.gate_exps)?)
    }

    /// The router's logits `[n, n_expert]` of `x`, then each token's experts and weights `[n, k]` on the
    /// card, chosen with `bias` where one is given.
    fn route(
        &self,
        x: &DevAct,
        m: &Moe,
        (ids, weights): (&mut DeviceBuffer<i32>, &mut DeviceBuffer<f32>),
        bias: Option<ops::SelectionBias<'_>>,
    ) -> CudaResult<()> {
        let dev = self.dev;
        let routing = Routing {
            n_expert: m.n_expert,
            k: m.n_expert_used,
            gating: match m.gating {
                Gating::Softmax => KGating::Softmax,
                Gating::Sigmoid => KGating::Sigmoid,
            },
            norm: m.norm_weights,
            scale: m.weights_scale,
        };
        // One token's float router and the choice of its experts in one launch.
        if let (1, true, GpuWeight::Float(s)) = (
            x.rows,
            fuse_on(Fusion::RouterTopk),
            self.weights.matrix(m.router)?,
        ) {
            if ops::router_topk_takes(s.table().ty) {
                let t = self.op_begin();
                let mut logits = self.pool.f32(dev, m.n_expert)?;
                let mut tickets = self.pool.tickets(dev)?;
                let r = ops::router_topk_biased(
                    dev,
                    (s.table(), x.buf()?),
                    &routing,
                    bias,
                    (&mut logits, &mut tickets),
                    (ids, weights),
                );
                self.pool.put_tickets(tickets);
                self.pool.put_f32(logits);
                self.op_end("moe.router_topk", t);
                return r;
            }
        }
        let t = self.op_begin();
        let mut la = DevAct {
            rows: x.rows,
            cols: m.n_expert,
            id: self.new_id(),
            buf: Some(self.pool.f32(dev, x.rows * m.n_expert)?),
            pool: self.pool.clone(),
        };
        self.matmul_into(m.router, x, &mut la)?;
        self.op_end("moe.router", t);
        let t = self.op_begin();
        ops::route_topk_biased(dev, la.buf()?, &routing, bias, ids, weights)?;
        self.op_end("moe.route_topk", t);
        Ok(())
    }

    /// One token's MoE layer of a segmented decode graph ([`super::super::decode_graph`]): the router
    /// into the step's buffers, a host point (the cache makes the routed experts computable), the card's
    /// experts, a host point (the CPU's share summed into the step's `cpu_sum`), then the card's weighted
    /// sum added to it. Running, the host points run here; capturing, the capture is cut there and a
    /// replay runs them.
    fn moe_segmented(
        &mut self,
        x: &DevAct,
        m: &Moe,
        (layer, shared): (usize, Option<&SharedExpert>),
        out: &mut DevAct,
    ) -> CudaResult<Option<DevAct>> {
        let dev = self.dev;
        let cache = self
            .experts
            .as_deref()
            .ok_or_else(|| CudaError::Invalid("a segmented MoE step without its cache".into()))?;
        let tables = cache.tables(layer)?;
        let g = self
            .graph
            .as_mut()
            .ok_or_else(|| CudaError::Invalid("a segmented MoE step outside a graph".into()))?;
        let (i, capturing) = (g.steps.next, g.capturing);
        g.steps.next += 1;
        if !capturing && i == g.steps.steps.len() {
            let biased = cache.selection_bias(layer).is_some();
            let shape = (x.cols, shared.is_some(), biased);
            let step = MoeStep::new(dev, (layer, tables), m, shape)?;
            g.steps.steps.push(Some(step));
            // The step before guesses this one's experts (its captured launches will).
            if let (true, Some(Some(before))) = (
                guesses_on_card(),
                i.checked_sub(1).and_then(|b| g.steps.steps.get_mut(b)),
            ) {
                before.guess_next_on_card(dev, m)?;
            }
        }
        let mut step = g
            .steps
            .steps
            .get_mut(i)
            .and_then(Option::take)
            .ok_or_else(|| CudaError::Invalid(format!("MoE step {i} was not made")))?;
        let r = self.moe_step(x, m, (i, &mut step, capturing), shared, out);
        if let Some(slot) = self.graph.as_mut().and_then(|g| g.steps.steps.get_mut(i)) {
            *slot = Some(step);
        }
        r
    }

    fn moe_step(
        &mut self,
        x: &DevAct,
        m: &Moe,
        (i, step, capturing): (usize, &mut MoeStep, bool),
        shared: Option<&SharedExpert>,
        out: &mut DevAct,
    ) -> CudaResult<Option<DevAct>> {
        let dev = self.dev;
        if step.shared != shared.is_some() {
            return Err(CudaError::Invalid(format!(
                "MoE step {i} made with a shared expert {}, now {}",
                step.shared,
                shared.is_some()
            )));
        }
        // The step's bias was decided when it was made, and its downloads follow that (the choices' word
        // among them): so the capture after the running call passes the vector even if the running call's
        // admissions completed the cache meanwhile (a segmented graph gives way to a whole one at the next
        // token then). A replay reads the vector's contents of its own token.
        let bias = match step.biased {
            true => self
                .experts
                .as_deref()
                .and_then(|c| c.bias_vector(step.layer)),
            false => None,
        };
        let selection = bias.map(|(bias, offset)| ops::SelectionBias {
            bias,
            offset,
            changed: Some(&mut step.changed),
        });
        self.route(x, m, (&mut step.ids, &mut step.weights), selection)?;
        // The next layer's experts guessed from this layer's input (a replay's host reads them; the
        // running call has no use for them): in a token of one graph behind the route point and a flag
        // of their own, with cuts before the route point.
        let by_flags = self.graph.as_ref().is_some_and(|g| g.steps.flags.is_some());
        if capturing && !by_flags {
            self.guess_next(x, step)?;
        }
        step.queue_downloads(dev, x.buf()?, !by_flags)?;
        let mut times = HostTimes::default();
        if capturing {
            self.host_point(HostPoint::Route(i))?;
            if by_flags && self.guess_next(x, step)? {
                step.queue_guess_download(dev)?;
                self.signal_guess(i)?;
            }
        } else {
            step.wait_route(dev, &mut times)?;
        }
        // The shared expert while the host decides (a segment of its own between the two host points).
        let shared_out = match shared {
            Some(s) => {
                let y = composed::shared_expert(self, x, s);
                if capturing {
                    self.host_point(HostPoint::Prepare(i))?;
                }
                Some(y)
            }
            None => None,
        };
        // Running, the host stages its copies before queueing the card's experts and computes the CPU's
        // share after (the launches borrow the forward); a replay does both beside the share.
        let share = match capturing {
            true => None,
            false => {
                let cache = self.experts.as_deref_mut().ok_or_else(|| {
                    CudaError::Invalid("a segmented MoE step without its cache".into())
                })?;
                let prep = step.prepare((dev, self.cpu), cache, &mut times)?;
                step.stage((dev, self.cpu), cache, &prep.copies, &mut times)?;
                prep.share
            }
        };
        if capturing {
            self.host_point(HostPoint::Staged(i))?;
        }
        step.queue_sources(dev)?;
        let [g, u, d] = &step.tables;
        let y = self
            .moe_slots(x, &step.slot_ids, m, [g, u, d], None)?
            .ok_or_else(|| CudaError::Invalid("a segmented step's experts were summed".into()))?;
        let r = if capturing {
            self.host_point(HostPoint::CpuShare(i))
        } else {
            match self.experts.as_deref_mut() {
                Some(cache) => step
                    .cpu_share(self.cpu, cache, share, &mut times)
                    .and_then(|()| step.finish((dev, self.cpu), cache, &mut times)),
                None => Err(CudaError::Invalid(
                    "a segmented MoE step without its cache".into(),
                )),
            }
        };
        let t = self.op_begin();
        let r = r
            .and_then(|()| step.queue_sum(dev, out.buf_mut()?))
            .and_then(|()| {
                ops::moe_combine(
                    dev,
                    &y,
                    &step.weights,
                    m.n_expert_used,
                    true,
                    out.buf_mut()?,
                )
            });
        self.pool.put_f32(y);
        self.op_end("moe.combine", t);
        r.map(|()| shared_out)
    }

    /// Queues the card's guess of the next MoE layer's experts from this layer's input `x`, leaning as
    /// that layer's choice will; false where `step` does not guess.
    fn guess_next(&mut self, x: &DevAct, step: &mut MoeStep) -> CudaResult<bool> {
        let next_bias = step
            .card_guess()
            .and_then(|(next, ..)| self.cache_bias(&next, x.rows));
        let Some((next, ids, weights)) = step.card_guess() else {
            return Ok(false);
        };
        let selection = next_bias.map(|(bias, offset)| ops::SelectionBias {
            bias,
            offset,
            changed: None,
        });
        self.route(x, &next, (ids, weights), selection)?;
        Ok(true)
    }

    /// Queues the card's signal that step `i`'s guess is down (a capture of one graph a token).
    fn signal_guess(&mut self, i: usize) -> CudaResult<()> {
        let flags = self
            .graph
            .as_ref()
            .and_then(|g| g.steps.flags.as_ref())
            .ok_or_else(|| CudaError::Invalid("a guess's signal without flags".into()))?;
        queue_guess_signal(self.dev, flags, i)
    }

    /// A host point met by a capture: the card's side of its flag queued when the token is one graph
    /// (the steps hold flags), else the capture cut there (`Staged` is no cut: the experts' segment
    /// starts at the point before it).
    fn host_point(&mut self, point: HostPoint) -> CudaResult<()> {
        let dev = self.dev;
        let g = self
            .graph
            .as_ref()
            .ok_or_else(|| CudaError::Invalid("a host point outside a graph".into()))?;
        match (&g.steps.flags, point) {
            (Some(flags), _) => point.queue_on_flags(dev, flags),
            (None, HostPoint::Staged(_)) => Ok(()),
            (None, _) => self.cut(point),
        }
    }

    /// Ends the graph captured so far as a segment followed by the host's `point`.
    fn cut(&mut self, point: HostPoint) -> CudaResult<()> {
        let segment = self.dev.cut_capture()?;
        let g = self
            .graph
            .as_mut()
            .ok_or_else(|| CudaError::Invalid("a capture cut outside a graph".into()))?;
        g.steps.segments.push((segment, point));
        Ok(())
    }

    /// The card's experts (grouped by expert for a prompt, slot by slot for one token) and, while the card
    /// computes them, the CPU's share: its sum goes into `out` first and the card's weighted sum adds to it.
    /// `routing` is the ids and weights `[n, k]`; `cache` the cache's layer and the CPU's share.
    pub(super) fn moe_card_and_cpu(
        &mut self,
        x: &DevAct,
        (ids, weights): (&DeviceBuffer<i32>, &DeviceBuffer<f32>),
        m: &Moe,
        (cached, cpu_share, leave_slots): (Option<usize>, Option<&CpuShare>, bool),
        out: &mut DevAct,
    ) -> CudaResult<Option<DeviceBuffer<f32>>> {
        let dev = self.dev;
        let (n, k) = (x.rows, m.n_expert_used);
        let card = {
            let tables = self.expert_tables(m, cached)?;
            let grouped = n > 1 && tables.iter().all(|t| prompt::has_matmul_experts(t.ty));
            if grouped {
                let (y, g) = self.moe_grouped(x, ids, m, tables)?;
                CardExperts::Grouped(y, g)
            } else {
                // Without a CPU share the down experts may sum into the output themselves (unless
                // the caller sums the slots in a launch of its own).
                let sum = match cpu_share {
                    None if !leave_slots => Some((weights, out.buf_mut()?)),
                    _ => None,
                };
                match self.moe_slots(x, ids, m, tables, sum)? {
                    Some(y) => CardExperts::Slots(y),
                    None => CardExperts::Summed,
                }
            }
        };
        let accumulate = match cpu_share {
            Some(share) => {
                let sum = share.compute_for(self.experts.as_deref_mut(), self.cpu, m);
                dev.write(&sum, out.buf_mut()?)?;
                true
            }
            None => false,
        };
        // The caller sums the slots in a launch of its own.
        let card = match card {
            CardExperts::Slots(y) if leave_slots && !accumulate => return Ok(Some(y)),
            card => card,
        };
        let t = self.op_begin();
        let r = match card {
            CardExperts::Grouped(y, g) => {
                let r = moe_combine_sorted(
                    dev,
                    &y,
                    &g.slot_row,
                    weights,
                    k,
                    accumulate,
                    out.buf_mut()?,
                );
                self.pool.put_f32(y);
                g.give_back(&self.pool);
                r
            }
            CardExperts::Slots(y) => {
                let r = ops::moe_combine(dev, &y, weights, k, accumulate, out.buf_mut()?);
                self.pool.put_f32(y);
                r
            }
            CardExperts::Summed => Ok(()),
        };
        self.op_end("moe.combine", t);
        r.map(|()| None)
    }

    /// Groups a prompt's routing (`ids` `[n, k]` on the card) by expert for the grouped kernels: on the
    /// card ([`prompt::group_by_expert`]); with `--moe-group host` (or more experts than it takes) the
    /// ids come to the host (one wait per layer), are sorted there ([`ExpertGrouping`]) and the sorted
    /// order, the way back and the tile table go to the card. The tile table has a fixed length per shape
    /// (padded with empty tiles) so the pool keeps one buffer for it. The one place that decides which
    /// expert a tile reads: an expert cache can rewrite the table here.
    pub(super) fn group_experts(
        &self,
        ids: &DeviceBuffer<i32>,
        k: usize,
        n_expert: usize,
        tile_rows: usize,
    ) -> CudaResult<ExpertGroups> {
        let dev = self.dev;
        if n_expert <= prompt::GROUP_MAX_EXPERTS && !prompt::host_grouping() {
            // On the card: the host queues on without waiting for the router.
            let slots = ids.len();
            let n_tiles = ExpertGrouping::max_tiles(slots, n_expert, tile_rows);
            let mut rows = self.pool.i32(dev, slots)?;
            let mut slot_row = self.pool.i32(dev, slots)?;
            let mut tiles = self.pool.i32(dev, 3 * n_tiles)?;
            let r = prompt::group_by_expert(
                dev,
                ids,
                (k, n_expert, tile_rows),
                &mut rows,
                &mut slot_row,
                &mut tiles,
            );
            let g = ExpertGroups {
                rows,
                slot_row,
                tiles,
                tile_rows,
            };
            return match r {
                Ok(()) => Ok(g),
                Err(e) => {
                    g.give_back(&self.pool);
                    Err(e)
                }
            };
        }
        let host_ids = dev.download(ids)?;
        let g = ExpertGrouping::with_tile(&host_ids, k, n_expert, tile_rows);
        let n_tiles = ExpertGrouping::max_tiles(host_ids.len(), n_expert, tile_rows);
        let mut rows = self.pool.i32(dev, g.rows.len())?;
        dev.write(&g.rows, &mut rows)?;
        let mut slot_row = self.pool.i32(dev, g.slot_row.len())?;
        dev.write(&g.slot_row, &mut slot_row)?;
        let table = g.tile_table(n_tiles);
        let mut tiles = self.pool.i32(dev, table.len())?;
        dev.write(&table, &mut tiles)?;
        Ok(ExpertGroups {
            rows,
            slot_row,
            tiles,
            tile_rows,
        })
    }

    /// The routed experts of a prompt grouped by expert: the rows gathered into expert order and
    /// quantized once, gate and up as grouped matmuls, the activation, down. Returns the `[slots, n_embd]`
    /// outputs in expert order and the grouping (whose `slot_row` sums them back per token).
    pub(super) fn moe_grouped(
        &self,
        x: &DevAct,
        ids: &DeviceBuffer<i32>,
        m: &Moe,
        [gate_t, up_t, down_t]: [&ExpertTable; 3],
    ) -> CudaResult<(DeviceBuffer<f32>, ExpertGroups)> {
        let dev = self.dev;
        let (n, n_embd, k) = (x.rows, x.cols, m.n_expert_used);
        let slots = n * k;
        let n_ff = gate_t.rows;
        let tile_rows = prompt::expert_tile_rows(dev, gate_t, slots, m.n_expert);
        // Profiled as steps (moe.group: the ids to the host and the grouping back; moe.gather: the rows in
        // expert order, quantized; moe.gate_up, moe.act, moe.down).
        let t = self.op_begin();
        let g = self.group_experts(ids, k, m.n_expert, tile_rows)?;
        self.op_end("moe.group", t);
        let t = self.op_begin();
        // The tokens quantized once ([n, n_embd/32] blocks), then put in expert order for gate and up:
        // [slots, n_embd/32] (the blocks gathering the f32 rows and quantizing them would give).
        let mut xq = self.pool.q8(dev, slots * n_embd / 32)?;
        let r = self.with_q8(None, x.buf()?, |xq_tokens| {
            gather_rows_q8_1(dev, xq_tokens, &g.rows, n_embd / 32, &mut xq)
        });
        if let Err(e) = r {
            self.pool.put_q8(xq);
            g.give_back(&self.pool);
            return Err(e);
        }
        self.op_end("moe.gather", t);
        let t = self.op_begin();
        // [slots, n_ff] each.
        let mut gate = self.pool.f32(dev, slots * n_ff)?;
        let mut up = self.pool.f32(dev, slots * n_ff)?;
        prompt::matmul_experts_q_pair(
            dev,
            [gate_t, up_t],
            &g.tiles,
            g.tile_rows,
            &xq,
            [&mut gate, &mut up],
        )?;
        self.pool.put_q8(xq);
        self.op_end("moe.gate_up", t);
        let t = self.op_begin();
        let mut hq = self.pool.q8(dev, slots * n_ff / 32)?;
        if matches!(m.act, Unary::Silu) {
            // SwiGLU straight into the down experts' quantized input (the values of swiglu then quantize).
            ops::swiglu_quantize_q8_1(dev, &gate, &up, &mut hq)?;
            self.pool.put_f32(gate);
            self.pool.put_f32(up);
        } else {
            let mut h = self.pool.f32(dev, slots * n_ff)?;
            self.glu(m.act, n_ff, &mut gate, &up, &mut h)?;
            self.pool.put_f32(gate);
            self.pool.put_f32(up);
            ops::quantize_q8_1(dev, &h, &mut hq)?;
            self.pool.put_f32(h);
        }
        self.op_end("moe.act", t);
        let t = self.op_begin();
        // [slots, n_embd] in expert order.
        let mut y = self.pool.f32(dev, slots * n_embd)?;
        let down_tile = prompt::expert_tile_rows(dev, down_t, slots, m.n_expert);
        let r = if down_tile == g.tile_rows {
            matmul_experts_q(dev, down_t, &g.tiles, g.tile_rows, &hq, &mut y)
        } else {
            let gd = self.group_experts(ids, k, m.n_expert, down_tile)?;
            let r = matmul_experts_q(dev, down_t, &gd.tiles, gd.tile_rows, &hq, &mut y);
            gd.give_back(&self.pool);
            r
        };
        self.pool.put_q8(hq);
        self.op_end("moe.down", t);
        if let Err(e) = r {
            self.pool.put_f32(y);
            g.give_back(&self.pool);
            return Err(e);
        }
        Ok((y, g))
    }

    /// `h = act(gate) · up` over rows of `width`; `gate` may be overwritten.
    pub(super) fn glu(
        &self,
        act: Unary,
        width: usize,
        gate: &mut DeviceBuffer<f32>,
        up: &DeviceBuffer<f32>,
        h: &mut DeviceBuffer<f32>,
    ) -> CudaResult<()> {
        let dev = self.dev;
        match act {
            Unary::Silu => ops::swiglu(dev, gate, up, h),
            Unary::Gelu => ops::geglu(dev, gate, up, h),
            f => {
                self.unary_into(gate, f, h)?;
                ew::binary(dev, h, up, width, BinaryOp::Mul, Broadcast::None, gate)?;
                std::mem::swap(h, gate);
                Ok(())
            }
        }
    }

    /// One token's routed experts with SiLU and quantized experts: gate and up in one launch writing
    /// `silu(gate)·up` `[k, n_ff]` and (`glu-q8`) its quantized copy for the down experts, which write the
    /// `[k, n_embd]` outputs in slot order, returned, or (`down-sum`, with `sum`) also their weighted sum
    /// into `sum`'s output, returning `None`. The values of the separate launches bit for bit.
    pub(super) fn moe_token_fused(
        &self,
        x: &DevAct,
        ids: &DeviceBuffer<i32>,
        [gate_t, up_t, down_t]: [&ExpertTable; 3],
        sum: Option<SlotSumInto<'_>>,
    ) -> CudaResult<Option<DeviceBuffer<f32>>> {
        let mut tickets = self.pool.tickets(self.dev)?;
        let r = self.token_experts(x, ids, [gate_t, up_t, down_t], (sum, &mut tickets));
        self.pool.put_tickets(tickets);
        r
    }

    fn token_experts(
        &self,
        x: &DevAct,
        ids: &DeviceBuffer<i32>,
        [gate_t, up_t, down_t]: [&ExpertTable; 3],
        (sum, tickets): (Option<SlotSumInto<'_>>, &mut Tickets),
    ) -> CudaResult<Option<DeviceBuffer<f32>>> {
        let dev = self.dev;
        let slots = ids.len();
        let n_ff = gate_t.rows;
        let glu_q8 = fuse_on(Fusion::GluQ8)
            && ops::glu_q8_takes(gate_t.ty, n_ff, gate_t.cols, slots)
            && slots * n_ff / 32 <= tickets.len();
        let t = self.op_begin();
        let mut h = self.pool.f32(dev, slots * n_ff)?;
        let mut hq = self.pool.q8(dev, slots * n_ff / 32)?;
        let r = self.with_q8(Some(x.id), x.buf()?, |xq| match glu_q8 {
            true => ops::matvec_experts_glu_q8(
                dev,
                (gate_t, up_t),
                (ids, xq),
                &mut h,
                (&mut hq, &mut *tickets),
            ),
            false => ops::matvec_experts_glu_q_ahead(dev, (gate_t, up_t), down_t, ids, xq, &mut h),
        });
        self.op_end("moe.gate_up", t);
        let r = match glu_q8 {
            true => r,
            false => {
                let t = self.op_begin();
                let r = r.and_then(|()| ops::quantize_q8_1(dev, &h, &mut hq));
                self.op_end("moe.act", t);
                r
            }
        };
        self.pool.put_f32(h);
        let t = self.op_begin();
        let mut y = self.pool.f32(dev, slots * x.cols)?;
        let sum = sum.filter(|_| {
            fuse_on(Fusion::DownSum)
                && ops::slot_sum_tickets(down_t.ty, down_t.rows, down_t.cols, slots)
                    <= tickets.len()
        });
        let r = r.and_then(|()| match sum {
            Some((weights, out)) => {
                let into = ops::SlotSum {
                    weights,
                    out,
                    accumulate: false,
                    tickets: &mut *tickets,
                };
                let input = (ids, &hq, ExpertInput::PerSlot);
                ops::matvec_experts_q_sum(dev, down_t, input, &mut y, into).map(|()| true)
            }
            None => ops::matvec_experts_q(dev, down_t, ids, &hq, ExpertInput::PerSlot, &mut y)
                .map(|()| false),
        });
        self.pool.put_q8(hq);
        self.op_end("moe.down", t);
        match r {
            Ok(false) => Ok(Some(y)),
            Ok(true) => {
                self.pool.put_f32(y);
                Ok(None)
            }
            Err(e) => {
                self.pool.put_f32(y);
                Err(e)
            }
        }
    }

    /// The routed experts slot by slot (one token, or experts the grouped kernels do not take): the
    /// `[slots, n_embd]` outputs in slot order.
    /// With `sum`, the down experts may also sum the slots into its output (see [`Self::moe_token_fused`]):
    /// then `None`.
    pub(super) fn moe_slots(
        &self,
        x: &DevAct,
        ids: &DeviceBuffer<i32>,
        m: &Moe,
        [gate_t, up_t, down_t]: [&ExpertTable; 3],
        sum: Option<SlotSumInto<'_>>,
    ) -> CudaResult<Option<DeviceBuffer<f32>>> {
        let dev = self.dev;
        let (n, n_embd, k) = (x.rows, x.cols, m.n_expert_used);
        let slots = n * k;
        let n_ff = gate_t.rows;
        let q8 = |ty| ops::activation_form(ty) == Some(ops::ActivationForm::Q8_1);
        if n == 1
            && matches!(m.act, Unary::Silu)
            && gate_t.ty == up_t.ty
            && q8(gate_t.ty)
            && q8(down_t.ty)
            && fused_glu_on()
        {
            return self.moe_token_fused(x, ids, [gate_t, up_t, down_t], sum);
        }
        let t = self.op_begin();
        // Each slot's input: one token's row for all its experts (a single token shares it).
        let (input, x_rep) = if n == 1 {
            (ExpertInput::Shared, None)
        } else {
            let mut rep = self.pool.f32(dev, slots * n_embd)?;
            ew::repeat_heads(dev, x.buf()?, n, n_embd, k, true, &mut rep)?;
            (ExpertInput::PerSlot, Some(rep))
        };
        let x_in = match &x_rep {
            Some(r) => r,
            None => x.buf()?,
        };
        let mut gate = self.pool.f32(dev, slots * n_ff)?;
        let mut up = self.pool.f32(dev, slots * n_ff)?;
        let x_id = (n == 1).then_some(x.id);
        self.experts_mul(gate_t, ids, (x_in, x_id), input, &mut gate)?;
        self.experts_mul(up_t, ids, (x_in, x_id), input, &mut up)?;
        if let Some(r) = x_rep {
            self.pool.put_f32(r);
        }
        self.op_end("moe.gate_up", t);
        let t = self.op_begin();
        // One token with SiLU and quantized down experts: the SwiGLU goes straight into the down experts'
        // quantized input (the same values as swiglu then quantize, one launch fewer).
        if n == 1
            && matches!(m.act, Unary::Silu)
            && ops::activation_form(down_t.ty) == Some(ops::ActivationForm::Q8_1)
        {
            let mut hq = self.pool.q8(dev, slots * n_ff / 32)?;
            let r = ops::swiglu_quantize_q8_1(dev, &gate, &up, &mut hq);
            self.pool.put_f32(gate);
            self.pool.put_f32(up);
            self.op_end("moe.act", t);
            let t = self.op_begin();
            let mut y = self.pool.f32(dev, slots * n_embd)?;
            let r = r.and_then(|()| {
                ops::matvec_experts_q(dev, down_t, ids, &hq, ExpertInput::PerSlot, &mut y)
            });
            self.pool.put_q8(hq);
            self.op_end("moe.down", t);
            return match r {
                Ok(()) => Ok(Some(y)),
                Err(e) => {
                    self.pool.put_f32(y);
                    Err(e)
                }
            };
        }
        let mut h = self.pool.f32(dev, slots * n_ff)?;
        self.glu(m.act, n_ff, &mut gate, &up, &mut h)?;
        self.pool.put_f32(gate);
        self.pool.put_f32(up);
        self.op_end("moe.act", t);
        let t = self.op_begin();
        let mut y = self.pool.f32(dev, slots * n_embd)?;
        let r = self.experts_mul(down_t, ids, (&h, None), ExpertInput::PerSlot, &mut y);
        self.pool.put_f32(h);
        self.op_end("moe.down", t);
        match r {
            Ok(()) => Ok(Some(y)),
            Err(e) => {
                self.pool.put_f32(y);
                Err(e)
            }
        }
    }

    /// The gate, up and down expert tables of `m`: the cache's for its layer, else the uploaded tensors'.
    pub(super) fn expert_tables(
        &self,
        m: &Moe,
        cached: Option<usize>,
    ) -> CudaResult<[&ExpertTable; 3]> {
        match (cached, self.experts.as_deref()) {
            (Some(layer), Some(cache)) => {
                let [g, u, d] = cache.tables(layer)?;
                Ok([g, u, d])
            }
            _ => Ok([
                self.table(m.gate_exps)?,
                self.table(m.up_exps)?,
                self.table(m.down_exps)?,
            ]),
        }
    }
}
