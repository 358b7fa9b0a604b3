//! Typed device memory: [`DeviceBuffer`] (a `CudaSlice` of one element type), [`BlockQ8_1`] (the quantized
//! activation block, so a float buffer cannot be passed where quants are read), [`DeviceMatrix`] (a weight
//! matrix on the card in its GGUF format) and the experts of a layer ([`ExpertTable`], [`StackedExperts`]).

use super::formats::q_format;
use super::{CudaError, CudaResult, Device};
use crate::quant::GgmlType;
use cudarc::driver::{CudaSlice, DevicePtr, DeviceRepr, ValidAsZeroBits};

/// Device memory of `len` elements of `T`, freed (in stream order) when dropped.
pub struct DeviceBuffer<T> {
    slice: CudaSlice<T>,
}

impl<T> std::fmt::Debug for DeviceBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DeviceBuffer<{}>[{}]",
            std::any::type_name::<T>(),
            self.slice.len()
        )
    }
}

impl<T> DeviceBuffer<T> {
    pub(crate) fn from_slice(slice: CudaSlice<T>) -> Self {
        DeviceBuffer { slice }
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.slice.len()
    }

    /// Whether it holds no element (never, for buffers made by [`Device`]).
    pub fn is_empty(&self) -> bool {
        self.slice.is_empty()
    }

    /// Bytes.
    pub fn num_bytes(&self) -> usize {
        self.slice.num_bytes()
    }

    pub(crate) fn slice(&self) -> &CudaSlice<T> {
        &self.slice
    }

    pub(crate) fn slice_mut(&mut self) -> &mut CudaSlice<T> {
        &mut self.slice
    }

    /// The device address of element 0 (for address tables the kernels read).
    pub(crate) fn address(&self) -> u64 {
        // Event tracking is off (see `device.rs`), so the guard records nothing.
        let (ptr, _guard) = self.slice.device_ptr(self.slice.stream());
        ptr
    }
}

/// One activation block as the integer dot products read it: 32 values, f16 scale `d`, f16 sum `s` of the
/// original values, 32 × i8 (ggml-cuda's `block_q8_1`; not the CPU's Q8_1, whose `s` is `d·Σq`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockQ8_1 {
    pub bytes: [u8; 36],
}

impl Default for BlockQ8_1 {
    fn default() -> Self {
        BlockQ8_1 { bytes: [0; 36] }
    }
}

impl BlockQ8_1 {
    /// Values per block.
    pub const ELEMS: usize = 32;

    /// The scale.
    pub fn d(&self) -> f32 {
        half::f16::from_le_bytes([self.bytes[0], self.bytes[1]]).to_f32()
    }

    /// `d` times the sum of the 32 quants (ggml's CPU q8_1; the formats with an offset or minimum use it).
    pub fn s(&self) -> f32 {
        half::f16::from_le_bytes([self.bytes[2], self.bytes[3]]).to_f32()
    }

    /// Quant `i`.
    pub fn q(&self, i: usize) -> i8 {
        self.bytes[4 + i] as i8
    }
}

// SAFETY: plain bytes with the layout of the kernels' `block_q8_1` (36 bytes, no padding).
unsafe impl DeviceRepr for BlockQ8_1 {}
// SAFETY: all-zero bytes are a valid block (scale 0, quants 0).
unsafe impl ValidAsZeroBits for BlockQ8_1 {}

/// How a weight format's matrix×vector takes its activations on the card.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GpuAct {
    /// f32 (float weights).
    F32,
    /// [`BlockQ8_1`] (quantized weights: integer dot products).
    Q8_1,
}

/// The activation form of `ty`'s GPU matrix×vector, or `None` when the GPU does not compute `ty` yet.
pub fn gpu_act(ty: GgmlType) -> Option<GpuAct> {
    match ty {
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => Some(GpuAct::F32),
        // Every format of the quantized kernels' table (formats.rs).
        ty if q_format(ty).is_some() => Some(GpuAct::Q8_1),
        _ => None,
    }
}

/// Checks that the GPU computes `ty` and that a row of `cols` values is whole blocks (and, for the 16-bit
/// float formats, an even count, which the kernels' paired loads need); returns the bytes of one row.
pub(crate) fn check_shape(ty: GgmlType, rows: usize, cols: usize) -> CudaResult<usize> {
    if gpu_act(ty).is_none() {
        return Err(CudaError::Invalid(format!(
            "the GPU does not compute {ty} matrices yet"
        )));
    }
    if rows == 0 || cols == 0 || cols > i32::MAX as usize || rows > i32::MAX as usize {
        return Err(CudaError::Invalid(format!(
            "{ty}: a {rows}×{cols} matrix is empty or too large"
        )));
    }
    let row_bytes = ty
        .bytes_for(cols as u64)
        .ok_or_else(|| CudaError::Invalid(format!("{ty}: {cols} columns are not whole blocks")))?;
    if !cols.is_multiple_of(2) || !(row_bytes as usize).is_multiple_of(2) {
        return Err(CudaError::Invalid(format!(
            "{ty}: {cols} columns (the kernels need an even count)"
        )));
    }
    Ok(row_bytes as usize)
}

/// A weight matrix on the card: `rows` rows of `cols` values of `ty`, row-major as GGUF stores it.
#[derive(Debug)]
pub struct DeviceMatrix {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    data: DeviceBuffer<u8>,
}

impl DeviceMatrix {
    /// Uploads `data` (exactly `rows` rows of `cols` values of `ty`).
    pub fn upload(
        dev: &Device,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        data: &[u8],
    ) -> CudaResult<Self> {
        let row_bytes = check_shape(ty, rows, cols)?;
        if rows.checked_mul(row_bytes) != Some(data.len()) {
            return Err(CudaError::Invalid(format!(
                "{ty}: {} bytes are not {rows} rows of {cols} values",
                data.len()
            )));
        }
        Ok(DeviceMatrix {
            ty,
            rows,
            cols,
            data: dev.upload(data)?,
        })
    }

    /// The weights' bytes.
    pub fn data(&self) -> &DeviceBuffer<u8> {
        &self.data
    }
}

/// The experts of one tensor of a layer (`[cols, rows, n_expert]` in GGUF: `n_expert` matrices of `rows` ×
/// `cols` of `ty`) as the expert kernels find them: a device array of one address per expert. An expert
/// whose address is 0 is not on the card; the kernels write 0 for its slots (the caller computes it
/// elsewhere). Today every address points into one allocation ([`StackedExperts`]); the VRAM expert cache
/// will point them at its slots and change them as experts come and go, without touching a captured graph.
#[derive(Debug)]
pub struct ExpertTable {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub n_expert: usize,
    /// The device array of addresses: `storage[offset..offset + n_expert]` (the tables of one cache
    /// layer share one array, so one write repoints all three).
    pub(crate) storage: std::sync::Arc<DeviceBuffer<u64>>,
    pub(crate) offset: usize,
    /// The array's device address, as the kernels take it.
    pub(crate) address: u64,
}

impl ExpertTable {
    /// A table over `storage[offset..offset + n_expert]`.
    pub(crate) fn over(
        (ty, rows, cols, n_expert): (GgmlType, usize, usize, usize),
        storage: std::sync::Arc<DeviceBuffer<u64>>,
        offset: usize,
    ) -> ExpertTable {
        let address = storage.address() + (offset * std::mem::size_of::<u64>()) as u64;
        ExpertTable {
            ty,
            rows,
            cols,
            n_expert,
            storage,
            offset,
            address,
        }
    }

    /// The address array's device address, the kernels' argument.
    pub(crate) fn table_address(&self) -> &u64 {
        &self.address
    }

    /// Bytes of one expert's matrix.
    pub fn expert_bytes(&self) -> usize {
        self.rows * self.ty.bytes_for(self.cols as u64).unwrap_or(0) as usize
    }
}

/// Every expert of a tensor in one allocation, with the [`ExpertTable`] pointing into it.
#[derive(Debug)]
pub struct StackedExperts {
    // Field order matters only for drop order, which is free: the table holds addresses, not references.
    table: ExpertTable,
    _storage: DeviceBuffer<u8>,
}

impl StackedExperts {
    /// Uploads `data`: `n_expert` matrices of `rows` × `cols` of `ty`, back to back (GGUF's layout of a
    /// `[cols, rows, n_expert]` tensor).
    pub fn upload(
        dev: &Device,
        ty: GgmlType,
        shape: (usize, usize, usize),
        data: &[u8],
    ) -> CudaResult<Self> {
        let (rows, cols, n_expert) = shape;
        let row_bytes = check_shape(ty, rows, cols)?;
        let expert_bytes = rows * row_bytes;
        if n_expert == 0
            || n_expert > i32::MAX as usize
            || expert_bytes.checked_mul(n_expert) != Some(data.len())
        {
            return Err(CudaError::Invalid(format!(
                "{ty}: {} bytes are not {n_expert} experts of {rows}×{cols}",
                data.len()
            )));
        }
        let storage = dev.upload(data)?;
        let base = storage.address();
        let addresses: Vec<u64> = (0..n_expert)
            .map(|e| base + (e * expert_bytes) as u64)
            .collect();
        let table = ExpertTable::over(
            (ty, rows, cols, n_expert),
            std::sync::Arc::new(dev.upload(&addresses)?),
            0,
        );
        Ok(StackedExperts {
            table,
            _storage: storage,
        })
    }

    /// The table the expert kernels read.
    pub fn table(&self) -> &ExpertTable {
        &self.table
    }
}
