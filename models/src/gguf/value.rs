//! GGUF metadata values: the 13 value types, scalars, typed arrays (arrays of arrays too), conversions
//! the accessors use, and convenience constructors for the writer.
//!
//! Arrays are stored typed (`Vec<f32>`, `Vec<String>`, …) rather than as `Vec<Value>`: a 500k-token
//! vocabulary then costs one allocation per token string and one per numeric array, and accessors can
//! hand out slices.

/// The value type ids of GGUF.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ValueType {
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    F32,
    Bool,
    String,
    Array,
    U64,
    I64,
    F64,
}

const VALUE_TYPES: [ValueType; 13] = [
    ValueType::U8,
    ValueType::I8,
    ValueType::U16,
    ValueType::I16,
    ValueType::U32,
    ValueType::I32,
    ValueType::F32,
    ValueType::Bool,
    ValueType::String,
    ValueType::Array,
    ValueType::U64,
    ValueType::I64,
    ValueType::F64,
];

impl ValueType {
    /// The type with GGUF id `id` (0 = u8 … 12 = f64).
    pub fn from_id(id: u32) -> Option<ValueType> {
        VALUE_TYPES.get(id as usize).copied()
    }

    /// The GGUF id.
    pub fn id(self) -> u32 {
        VALUE_TYPES
            .iter()
            .position(|&t| t == self)
            .map_or(0, |p| p as u32)
    }

    /// A short name (`"u32"`, `"string"`, …) for messages.
    pub fn name(self) -> &'static str {
        match self {
            ValueType::U8 => "u8",
            ValueType::I8 => "i8",
            ValueType::U16 => "u16",
            ValueType::I16 => "i16",
            ValueType::U32 => "u32",
            ValueType::I32 => "i32",
            ValueType::F32 => "f32",
            ValueType::Bool => "bool",
            ValueType::String => "string",
            ValueType::Array => "array",
            ValueType::U64 => "u64",
            ValueType::I64 => "i64",
            ValueType::F64 => "f64",
        }
    }

    /// Bytes one value of a fixed-size type takes in a file; `None` for strings and arrays.
    pub fn fixed_size(self) -> Option<usize> {
        match self {
            ValueType::U8 | ValueType::I8 | ValueType::Bool => Some(1),
            ValueType::U16 | ValueType::I16 => Some(2),
            ValueType::U32 | ValueType::I32 | ValueType::F32 => Some(4),
            ValueType::U64 | ValueType::I64 | ValueType::F64 => Some(8),
            ValueType::String | ValueType::Array => None,
        }
    }
}

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Array),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// A metadata array: all elements share one type; an empty array keeps its element type.
#[derive(Clone, Debug, PartialEq)]
pub enum Array {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    Bool(Vec<bool>),
    String(Vec<String>),
    /// An array of arrays; each inner array has its own element type and length.
    Array(Vec<Array>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F64(Vec<f64>),
}

impl Value {
    /// The value's GGUF type.
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::F32(_) => ValueType::F32,
            Value::Bool(_) => ValueType::Bool,
            Value::String(_) => ValueType::String,
            Value::Array(_) => ValueType::Array,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F64(_) => ValueType::F64,
        }
    }

    /// A description of the type for messages: `"u32"`, `"array of f32"`, ….
    pub fn type_description(&self) -> String {
        match self {
            Value::Array(a) => format!("array of {}", a.element_type().name()),
            v => v.value_type().name().to_string(),
        }
    }

    /// Any integer value, as an `i128` (which holds every GGUF integer exactly).
    fn as_integer(&self) -> Option<i128> {
        Some(match *self {
            Value::U8(v) => v.into(),
            Value::I8(v) => v.into(),
            Value::U16(v) => v.into(),
            Value::I16(v) => v.into(),
            Value::U32(v) => v.into(),
            Value::I32(v) => v.into(),
            Value::U64(v) => v.into(),
            Value::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// Whether the value is an integer of any width.
    pub fn is_integer(&self) -> bool {
        self.as_integer().is_some()
    }

    /// An integer of any width that fits in `u64`.
    pub fn as_u64(&self) -> Option<u64> {
        self.as_integer().and_then(|v| u64::try_from(v).ok())
    }

    /// An integer of any width that fits in `i64`.
    pub fn as_i64(&self) -> Option<i64> {
        self.as_integer().and_then(|v| i64::try_from(v).ok())
    }

    /// An integer of any width that fits in `u32`.
    pub fn as_u32(&self) -> Option<u32> {
        self.as_integer().and_then(|v| u32::try_from(v).ok())
    }

    /// An `f32`, or an `f64` narrowed to `f32`.
    pub fn as_f32(&self) -> Option<f32> {
        match *self {
            Value::F32(v) => Some(v),
            Value::F64(v) => Some(v as f32),
            _ => None,
        }
    }

    /// An `f64`, or an `f32` widened.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => None,
        }
    }

    /// A bool.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(v) => Some(v),
            _ => None,
        }
    }

    /// A string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    /// An array.
    pub fn as_array(&self) -> Option<&Array> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }

    /// An array of strings.
    pub fn string_array<I, S>(items: I) -> Value
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Value::Array(Array::String(items.into_iter().map(Into::into).collect()))
    }

    /// An array of `u32`.
    pub fn u32_array(items: impl IntoIterator<Item = u32>) -> Value {
        Value::Array(Array::U32(items.into_iter().collect()))
    }

    /// An array of `i32`.
    pub fn i32_array(items: impl IntoIterator<Item = i32>) -> Value {
        Value::Array(Array::I32(items.into_iter().collect()))
    }

    /// An array of `f32`.
    pub fn f32_array(items: impl IntoIterator<Item = f32>) -> Value {
        Value::Array(Array::F32(items.into_iter().collect()))
    }

    /// An array of bools.
    pub fn bool_array(items: impl IntoIterator<Item = bool>) -> Value {
        Value::Array(Array::Bool(items.into_iter().collect()))
    }
}

impl Array {
    /// The element type (`ValueType::Array` for arrays of arrays).
    pub fn element_type(&self) -> ValueType {
        match self {
            Array::U8(_) => ValueType::U8,
            Array::I8(_) => ValueType::I8,
            Array::U16(_) => ValueType::U16,
            Array::I16(_) => ValueType::I16,
            Array::U32(_) => ValueType::U32,
            Array::I32(_) => ValueType::I32,
            Array::F32(_) => ValueType::F32,
            Array::Bool(_) => ValueType::Bool,
            Array::String(_) => ValueType::String,
            Array::Array(_) => ValueType::Array,
            Array::U64(_) => ValueType::U64,
            Array::I64(_) => ValueType::I64,
            Array::F64(_) => ValueType::F64,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Array::U8(v) => v.len(),
            Array::I8(v) => v.len(),
            Array::U16(v) => v.len(),
            Array::I16(v) => v.len(),
            Array::U32(v) => v.len(),
            Array::I32(v) => v.len(),
            Array::F32(v) => v.len(),
            Array::Bool(v) => v.len(),
            Array::String(v) => v.len(),
            Array::Array(v) => v.len(),
            Array::U64(v) => v.len(),
            Array::I64(v) => v.len(),
            Array::F64(v) => v.len(),
        }
    }

    /// Whether the array has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every element as an `i128`, for an integer array of any width.
    fn integers(&self) -> Option<Vec<i128>> {
        Some(match self {
            Array::U8(v) => v.iter().map(|&x| x.into()).collect(),
            Array::I8(v) => v.iter().map(|&x| x.into()).collect(),
            Array::U16(v) => v.iter().map(|&x| x.into()).collect(),
            Array::I16(v) => v.iter().map(|&x| x.into()).collect(),
            Array::U32(v) => v.iter().map(|&x| x.into()).collect(),
            Array::I32(v) => v.iter().map(|&x| x.into()).collect(),
            Array::U64(v) => v.iter().map(|&x| x.into()).collect(),
            Array::I64(v) => v.iter().map(|&x| x.into()).collect(),
            _ => return None,
        })
    }

    /// Whether the elements are integers (of any width).
    pub fn is_integer(&self) -> bool {
        matches!(
            self,
            Array::U8(_)
                | Array::I8(_)
                | Array::U16(_)
                | Array::I16(_)
                | Array::U32(_)
                | Array::I32(_)
                | Array::U64(_)
                | Array::I64(_)
        )
    }

    /// An integer array of any width whose elements all fit in `u32`.
    pub fn to_u32_vec(&self) -> Option<Vec<u32>> {
        self.integers()?
            .into_iter()
            .map(|v| u32::try_from(v).ok())
            .collect()
    }

    /// An integer array of any width whose elements all fit in `i64`.
    pub fn to_i64_vec(&self) -> Option<Vec<i64>> {
        self.integers()?
            .into_iter()
            .map(|v| i64::try_from(v).ok())
            .collect()
    }

    /// An `f32` array (an `f64` array narrowed).
    pub fn to_f32_vec(&self) -> Option<Vec<f32>> {
        match self {
            Array::F32(v) => Some(v.clone()),
            Array::F64(v) => Some(v.iter().map(|&x| x as f32).collect()),
            _ => None,
        }
    }

    /// The strings of a string array.
    pub fn as_strings(&self) -> Option<&[String]> {
        match self {
            Array::String(v) => Some(v),
            _ => None,
        }
    }

    /// The values of an `f32` array.
    pub fn as_f32s(&self) -> Option<&[f32]> {
        match self {
            Array::F32(v) => Some(v),
            _ => None,
        }
    }

    /// The values of an `i32` array.
    pub fn as_i32s(&self) -> Option<&[i32]> {
        match self {
            Array::I32(v) => Some(v),
            _ => None,
        }
    }

    /// The values of a bool array.
    pub fn as_bools(&self) -> Option<&[bool]> {
        match self {
            Array::Bool(v) => Some(v),
            _ => None,
        }
    }

    /// The inner arrays of an array of arrays.
    pub fn as_arrays(&self) -> Option<&[Array]> {
        match self {
            Array::Array(v) => Some(v),
            _ => None,
        }
    }

    /// How deeply arrays nest: 1 for an array of scalars or strings.
    pub fn depth(&self) -> usize {
        match self {
            Array::Array(v) => 1 + v.iter().map(Array::depth).max().unwrap_or(0),
            _ => 1,
        }
    }
}

macro_rules! value_from {
    ($($t:ty => $variant:ident),* $(,)?) => {$(
        impl From<$t> for Value {
            fn from(v: $t) -> Value {
                Value::$variant(v)
            }
        }
        impl From<Vec<$t>> for Value {
            fn from(v: Vec<$t>) -> Value {
                Value::Array(Array::$variant(v))
            }
        }
        impl From<Vec<$t>> for Array {
            fn from(v: Vec<$t>) -> Array {
                Array::$variant(v)
            }
        }
    )*};
}

value_from!(
    u8 => U8, i8 => I8, u16 => U16, i16 => I16, u32 => U32, i32 => I32, f32 => F32, bool => Bool,
    String => String, u64 => U64, i64 => I64, f64 => F64,
);

impl From<&str> for Value {
    fn from(v: &str) -> Value {
        Value::String(v.to_string())
    }
}

impl From<Vec<&str>> for Value {
    fn from(v: Vec<&str>) -> Value {
        Value::string_array(v)
    }
}

impl From<Array> for Value {
    fn from(v: Array) -> Value {
        Value::Array(v)
    }
}

impl From<Vec<Array>> for Value {
    fn from(v: Vec<Array>) -> Value {
        Value::Array(Array::Array(v))
    }
}

impl From<Vec<Array>> for Array {
    fn from(v: Vec<Array>) -> Array {
        Array::Array(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integer_conversions_check_range() {
        assert_eq!(Value::I8(-1).as_u32(), None);
        assert_eq!(Value::I64(5).as_u32(), Some(5));
        assert_eq!(Value::U64(u64::MAX).as_u32(), None);
        assert_eq!(Value::U64(u64::MAX).as_i64(), None);
        assert_eq!(Value::U16(7).as_u64(), Some(7));
        assert_eq!(Value::F32(1.0).as_u32(), None);
        assert_eq!(Array::I32(vec![1, -1]).to_u32_vec(), None);
        assert_eq!(Array::U8(vec![1, 2]).to_u32_vec(), Some(vec![1, 2]));
    }

    #[test]
    fn type_ids_round_trip() {
        for id in 0..13 {
            let t = ValueType::from_id(id).expect("ids 0..13 are defined");
            assert_eq!(t.id(), id);
        }
        assert_eq!(ValueType::from_id(13), None);
        assert_eq!(ValueType::Array.id(), 9);
        assert_eq!(ValueType::F64.id(), 12);
    }

    #[test]
    fn depth_counts_nesting() {
        let nested = Array::Array(vec![
            Array::Array(vec![Array::U8(vec![1])]),
            Array::I8(vec![]),
        ]);
        assert_eq!(nested.depth(), 3);
        assert_eq!(Array::Array(vec![]).depth(), 1);
    }
}
