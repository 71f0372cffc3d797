//! Static shapes and the broadcasting rule.

use std::fmt;

/// The static shape of a graph value: a list of dimension sizes, outermost first.
///
/// Every shape is known when the node is built; there are no dynamic dimensions, because
/// neuronx-cc compiles one static graph per bucket.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct Shape(pub Vec<usize>);

impl Shape {
    /// The dimension sizes.
    pub fn dims(&self) -> &[usize] {
        &self.0
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.0.len()
    }

    /// Number of elements.
    pub fn elem_count(&self) -> usize {
        self.0.iter().product()
    }
}

impl From<&[usize]> for Shape {
    fn from(d: &[usize]) -> Self {
        Shape(d.to_vec())
    }
}

impl From<Vec<usize>> for Shape {
    fn from(d: Vec<usize>) -> Self {
        Shape(d)
    }
}

impl<const N: usize> From<[usize; N]> for Shape {
    fn from(d: [usize; N]) -> Self {
        Shape(d.to_vec())
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[")?;
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                write!(f, ", ")?;
            }
            write!(f, "{d}")?;
        }
        write!(f, "]")
    }
}

/// Whether `from` broadcasts to `to`: dims aligned right, each 1 or equal (the graph's one
/// broadcasting rule, which the HLO emitter spells out as reshape + broadcast).
pub(super) fn broadcast_compatible(from: &Shape, to: &Shape) -> bool {
    if from.rank() > to.rank() {
        return false;
    }
    let off = to.rank() - from.rank();
    from.0
        .iter()
        .enumerate()
        .all(|(i, &d)| d == 1 || d == to.0[off + i])
}

/// The shape both operands broadcast to, if any.
pub(super) fn broadcast_shape(a: &Shape, b: &Shape) -> Option<Shape> {
    let rank = a.rank().max(b.rank());
    let mut out = vec![0; rank];
    for (i, o) in out.iter_mut().enumerate() {
        let da = if i + a.rank() >= rank {
            a.0[i + a.rank() - rank]
        } else {
            1
        };
        let db = if i + b.rank() >= rank {
            b.0[i + b.rank() - rank]
        } else {
            1
        };
        *o = match (da, db) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => return None,
        };
    }
    Some(Shape(out))
}
