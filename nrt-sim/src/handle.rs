//! Opaque handles with generation counters, and the registry ([`Slab`]) behind them.
//!
//! The `nrt_tensor_t*`, `nrt_tensor_set_t*` and `nrt_model_t*` nrt-sim hands out are not
//! addresses: each is a 64-bit integer (cast to a pointer, never dereferenced by anyone)
//! that names a registry slot, the slot's generation, and the kind of object:
//!
//! ```text
//!  63 .. 47 | 46 .. 44 | 43 .. 24   | 23 .. 0
//!  zero     | kind     | generation | slot index + 1
//! ```
//!
//! Every handle is below 2^47, so it looks like a user-space address to a debugger, and
//! its low bits are never all zero, so no handle is null.
//!
//! Freeing an object bumps its slot's generation, so the old handle no longer matches:
//! a use after free or a double free is a lookup failure (`NRT_INVALID_HANDLE`), not a
//! read of freed memory. Handing out raw `Box` pointers instead was rejected because a freed
//! box cannot be recognised without dereferencing it (undefined behaviour), and leaking every
//! box to keep them recognisable grows memory without bound.
//!
//! Freed slots are reused first-in first-out, so a handle goes stale for as long as possible
//! before its slot comes back; a slot whose generation would wrap (2^20 reuses) is retired
//! instead, so a stale handle never aliases a live object.

use std::collections::VecDeque;
use std::ptr;

const INDEX_BITS: u32 = 24;
const GEN_BITS: u32 = 20;
const KIND_SHIFT: u32 = INDEX_BITS + GEN_BITS;
const INDEX_MASK: u64 = (1 << INDEX_BITS) - 1;
const GEN_MASK: u64 = (1 << GEN_BITS) - 1;
const KIND_MASK: u64 = 0b111;
/// Slots per registry (the largest index + 1 must fit the index bits, which hold index + 1).
const MAX_SLOTS: usize = (1 << INDEX_BITS) - 1;

/// What a handle refers to; encoded in the handle so one kind is never mistaken for another.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// `nrt_tensor_t*`.
    Tensor = 1,
    /// `nrt_tensor_set_t*`.
    TensorSet = 2,
    /// `nrt_model_t*`.
    Model = 3,
}

impl Kind {
    /// The C type's name, for messages.
    pub(crate) fn c_name(self) -> &'static str {
        match self {
            Kind::Tensor => "nrt_tensor_t",
            Kind::TensorSet => "nrt_tensor_set_t",
            Kind::Model => "nrt_model_t",
        }
    }
}

/// Why a handle did not resolve.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lookup {
    /// Null.
    Null,
    /// It was a handle of this kind, but the object was freed (use after free, double free,
    /// or an object released by `nrt_close`).
    Stale,
    /// Not a handle of this kind at all (another kind, a foreign pointer, garbage).
    Foreign,
}

/// A handle value: the integer behind the opaque pointer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct Handle(pub(crate) u64);

impl Handle {
    fn new(kind: Kind, index: usize, generation: u32) -> Handle {
        Handle(
            ((kind as u64) << KIND_SHIFT)
                | ((u64::from(generation) & GEN_MASK) << INDEX_BITS)
                | (index as u64 + 1),
        )
    }

    /// The handle behind a pointer received from C (its address; never dereferenced).
    pub(crate) fn from_ptr<T>(p: *const T) -> Handle {
        Handle(p.addr() as u64)
    }

    /// The pointer handed to C. It carries no provenance: it must never be dereferenced,
    /// and nothing does (C treats it as opaque; nrt-sim turns it back into a [`Handle`]).
    pub(crate) fn to_ptr<T>(self) -> *mut T {
        ptr::without_provenance_mut(self.0 as usize)
    }

    /// `(kind, index, generation)`, or `None` when the bits cannot be a handle.
    fn decode(self) -> Option<(u64, usize, u32)> {
        let kind = (self.0 >> KIND_SHIFT) & KIND_MASK;
        if self.0 >> (KIND_SHIFT + 3) != 0 {
            return None;
        }
        let index = (self.0 & INDEX_MASK).checked_sub(1)? as usize;
        let generation = ((self.0 >> INDEX_BITS) & GEN_MASK) as u32;
        Some((kind, index, generation))
    }
}

struct Slot<T> {
    generation: u32,
    value: Option<T>,
}

/// A registry of objects of one kind behind generation-checked [`Handle`]s.
pub(crate) struct Slab<T> {
    kind: Kind,
    slots: Vec<Slot<T>>,
    free: VecDeque<usize>,
    live: usize,
}

impl<T> Slab<T> {
    /// An empty registry for objects of `kind`.
    pub(crate) fn new(kind: Kind) -> Self {
        Slab {
            kind,
            slots: Vec::new(),
            free: VecDeque::new(),
            live: 0,
        }
    }

    /// Stores `value`; `None` when every slot is in use or retired.
    pub(crate) fn insert(&mut self, value: T) -> Option<Handle> {
        let index = match self.free.pop_front() {
            Some(i) => i,
            None if self.slots.len() < MAX_SLOTS => {
                self.slots.push(Slot {
                    generation: 0,
                    value: None,
                });
                self.slots.len() - 1
            }
            None => return None,
        };
        let slot = &mut self.slots[index];
        slot.value = Some(value);
        self.live += 1;
        Some(Handle::new(self.kind, index, slot.generation))
    }

    fn index_of(&self, h: Handle) -> Result<usize, Lookup> {
        if h.0 == 0 {
            return Err(Lookup::Null);
        }
        let (kind, index, generation) = h.decode().ok_or(Lookup::Foreign)?;
        if kind != self.kind as u64 {
            return Err(Lookup::Foreign);
        }
        let slot = self.slots.get(index).ok_or(Lookup::Foreign)?;
        if slot.generation != generation {
            // A generation this slot has not reached yet was never handed out.
            return Err(if generation < slot.generation {
                Lookup::Stale
            } else {
                Lookup::Foreign
            });
        }
        match slot.value {
            Some(_) => Ok(index),
            None => Err(Lookup::Stale),
        }
    }

    /// The live object behind `h`.
    pub(crate) fn get(&self, h: Handle) -> Result<&T, Lookup> {
        let i = self.index_of(h)?;
        self.slots[i].value.as_ref().ok_or(Lookup::Stale)
    }

    /// The live object behind `h`, mutably.
    pub(crate) fn get_mut(&mut self, h: Handle) -> Result<&mut T, Lookup> {
        let i = self.index_of(h)?;
        self.slots[i].value.as_mut().ok_or(Lookup::Stale)
    }

    /// Removes the object behind `h`; its handle (and every copy of it) goes stale.
    pub(crate) fn remove(&mut self, h: Handle) -> Result<T, Lookup> {
        let i = self.index_of(h)?;
        Ok(self.release(i).expect("index_of checked the slot is live"))
    }

    fn release(&mut self, i: usize) -> Option<T> {
        let slot = &mut self.slots[i];
        let value = slot.value.take()?;
        self.live -= 1;
        if u64::from(slot.generation) < GEN_MASK {
            slot.generation += 1;
            self.free.push_back(i);
        }
        // else: retired; its generation would wrap and let a stale handle match again.
        Some(value)
    }

    /// Removes every object (at `nrt_close`); all their handles go stale.
    pub(crate) fn drain(&mut self) -> Vec<T> {
        (0..self.slots.len())
            .filter_map(|i| self.release(i))
            .collect()
    }

    /// Live objects with their handles.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (Handle, &T)> {
        self.slots.iter().enumerate().filter_map(move |(i, s)| {
            s.value
                .as_ref()
                .map(|v| (Handle::new(self.kind, i, s.generation), v))
        })
    }

    /// Live objects, mutably.
    pub(crate) fn values_mut(&mut self) -> impl Iterator<Item = &mut T> {
        self.slots.iter_mut().filter_map(|s| s.value.as_mut())
    }

    /// How many objects are live.
    pub(crate) fn len(&self) -> usize {
        self.live
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_and_foreign_handles_are_told_apart() {
        let mut tensors = Slab::new(Kind::Tensor);
        let mut sets: Slab<()> = Slab::new(Kind::TensorSet);
        let a = tensors.insert("a").unwrap();
        assert_ne!(a.0, 0);
        assert!(a.0 < 1 << 47);
        assert_eq!(tensors.get(a), Ok(&"a"));
        assert_eq!(sets.get(a), Err(Lookup::Foreign));
        assert_eq!(tensors.remove(a), Ok("a"));
        assert_eq!(tensors.get(a), Err(Lookup::Stale));
        assert_eq!(tensors.remove(a), Err(Lookup::Stale), "double free");
        let b = tensors.insert("b").unwrap();
        assert_ne!(a, b, "a reused slot gets a new generation");
        assert_eq!(tensors.get(a), Err(Lookup::Stale));
        assert_eq!(tensors.get(Handle(0)), Err(Lookup::Null));
        assert_eq!(tensors.get(Handle(u64::MAX)), Err(Lookup::Foreign));
        assert_eq!(tensors.get(Handle(0xdead_beef)), Err(Lookup::Foreign));
        let s = sets.insert(()).unwrap();
        assert_eq!(tensors.get(s), Err(Lookup::Foreign));
        assert_eq!(Handle::from_ptr(b.to_ptr::<u8>()), b);
        assert_eq!(tensors.len(), 1);
        assert_eq!(tensors.drain(), vec!["b"]);
        assert_eq!(tensors.get(b), Err(Lookup::Stale));
        assert_eq!(tensors.len(), 0);
    }

    #[test]
    fn slots_are_reused_first_in_first_out() {
        let mut slab = Slab::new(Kind::Model);
        let hs: Vec<_> = (0..3).map(|i| slab.insert(i).unwrap()).collect();
        slab.remove(hs[0]).unwrap();
        slab.remove(hs[1]).unwrap();
        let next = slab.insert(9).unwrap();
        assert_eq!(
            next.decode().unwrap().1,
            0,
            "the oldest freed slot comes back first"
        );
        assert_eq!(slab.iter().count(), 2);
    }
}
