//! (family under construction)

use super::{GgmlType, QuantOps};

/// The operations of this family's types.
pub(crate) fn ops(_ty: GgmlType) -> Option<&'static QuantOps> {
    None
}
