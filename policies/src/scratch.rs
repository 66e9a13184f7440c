//! Reusable buffers for a decision's intermediate columns.
//!
//! A decision fills a column per kind for every candidate (what each holds, its load, each
//! scorer's scores, the picker's keys); a fresh vector for each would be an allocation each,
//! per request. A [`Buf`] is taken from a per-thread pool and returned to it, cleared, when it
//! drops: in the filter each Envoy worker's VM is one thread, and in the host each thread keeps
//! its own. Buffers never cross threads and hold no borrowed data, so nothing outlives a
//! decision but their capacity; one grown past [`KEEP`] elements is freed rather than kept.

use std::cell::RefCell;
use std::ops::{Deref, DerefMut};
use std::thread::LocalKey;

/// Buffers larger than this many elements are freed on return, not kept.
const KEEP: usize = 1 << 16;
/// Buffers kept per element type: a decision holds at most a few of one type at once.
const PER_TYPE: usize = 8;

/// An element type with spare buffers of its own on each thread.
pub trait Pooled: Sized + 'static {
    /// This thread's spare buffers of this type.
    fn spares() -> &'static LocalKey<RefCell<Vec<Vec<Self>>>>;
}

/// Gives each listed type a pool of spare buffers: `pooled!(T, U)`, in the module that owns
/// the type (so this module names none of the crate's types).
macro_rules! pooled {
    ($($ty:ty),* $(,)?) => {
        $(impl $crate::scratch::Pooled for $ty {
            fn spares() -> &'static std::thread::LocalKey<std::cell::RefCell<Vec<Vec<Self>>>> {
                thread_local! {
                    static SPARES: std::cell::RefCell<Vec<Vec<$ty>>> = const { std::cell::RefCell::new(Vec::new()) };
                }
                &SPARES
            }
        })*
    };
}
pub(crate) use pooled;

pooled!(
    usize,
    u32,
    f64,
    bool,
    (f64, usize),
    (u64, usize),
    (usize, f64, u64),
    (f64, u64, usize),
    (usize, f64),
    (u16, usize)
);

/// A vector from this thread's pool: empty, with whatever capacity it had. It goes back to the
/// pool when dropped.
pub struct Buf<T: Pooled>(Vec<T>);

impl<T: Pooled> Buf<T> {
    pub fn take() -> Self {
        let spare = T::spares().try_with(|p| p.try_borrow_mut().ok().and_then(|mut p| p.pop()));
        Self(spare.ok().flatten().unwrap_or_default())
    }
}

impl<T: Pooled> Drop for Buf<T> {
    fn drop(&mut self) {
        let mut v = std::mem::take(&mut self.0);
        if v.capacity() == 0 || v.capacity() > KEEP {
            return;
        }
        v.clear();
        // During the thread's exit the pool may be gone: the buffer is then simply freed.
        let _ = T::spares().try_with(|p| {
            if let Ok(mut pool) = p.try_borrow_mut() {
                if pool.len() < PER_TYPE {
                    pool.push(v);
                }
            }
        });
    }
}

impl<T: Pooled> Deref for Buf<T> {
    type Target = Vec<T>;

    fn deref(&self) -> &Vec<T> {
        &self.0
    }
}

impl<T: Pooled> DerefMut for Buf<T> {
    fn deref_mut(&mut self) -> &mut Vec<T> {
        &mut self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_returned_buffer_comes_back_empty_with_its_capacity() {
        let mut a = Buf::<u32>::take();
        a.extend(0..100);
        let ptr = a.as_ptr();
        drop(a);
        let b = Buf::<u32>::take();
        assert!(b.is_empty(), "cleared on return");
        assert!(b.capacity() >= 100);
        assert_eq!(b.as_ptr(), ptr, "the same allocation");
        // Two at once are two buffers.
        let c = Buf::<u32>::take();
        assert_ne!(b.as_ptr(), c.as_ptr());
    }

    #[test]
    fn a_huge_buffer_is_freed_not_kept() {
        let mut a = Buf::<(u64, usize)>::take();
        a.resize(KEEP + 1, (0, 0));
        drop(a);
        assert!(Buf::<(u64, usize)>::take().capacity() <= KEEP);
    }
}
