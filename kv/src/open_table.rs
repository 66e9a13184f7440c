//! A fixed-size open-addressing hash table with linear probing and backward-shift deletion.
//! Its size is set once from a capacity (no power-of-two rounding), so memory per entry is
//! predictable: `size_of::<V>() / load`. Keys are non-zero `u64` hashes; 0 marks an empty slot.

/// A value stored in the table, which also carries its key.
pub trait Entry: Copy + Default {
    fn key(&self) -> u64;
}

pub struct OpenTable<V: Entry> {
    slots: Vec<V>,
    len: usize,
    max_len: usize,
}

#[inline]
fn reduce(hash: u64, n: usize) -> usize {
    // Lemire's multiply-shift reduction over a mixed hash.
    let h = hash.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    ((u128::from(h) * n as u128) >> 64) as usize
}

impl<V: Entry> OpenTable<V> {
    /// A table for at most `capacity` entries, at most 80% full.
    pub fn with_capacity(capacity: usize) -> Self {
        let n = (capacity.max(1) * 5).div_ceil(4) + 1;
        // Written slot by slot, not `vec![]`'s zeroed allocation: the pages are resident from
        // the start, so the first events do not pay a page fault per 4 KB of table.
        let mut slots = Vec::with_capacity(n);
        slots.resize_with(n, V::default);
        Self { slots, len: 0, max_len: capacity.max(1) }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn is_full(&self) -> bool {
        self.len >= self.max_len
    }

    pub fn slot_count(&self) -> usize {
        self.slots.len()
    }

    pub fn heap_bytes(&self) -> usize {
        self.slots.len() * std::mem::size_of::<V>()
    }

    /// The slot holding `key` (`Ok`), or the empty slot where it would go (`Err`).
    #[inline]
    pub fn probe(&self, key: u64) -> Result<usize, usize> {
        let n = self.slots.len();
        let mut i = reduce(key, n);
        loop {
            let k = self.slots[i].key();
            if k == key {
                return Ok(i);
            }
            if k == 0 {
                return Err(i);
            }
            i += 1;
            if i == n {
                i = 0;
            }
        }
    }

    /// Put `v` in the empty slot `i` that [`probe`](Self::probe) returned for its key, with no
    /// change to the table in between. `None` if the table is full.
    #[inline]
    pub fn insert_at(&mut self, i: usize, v: V) -> Option<usize> {
        if self.is_full() || v.key() == 0 || self.slots[i].key() != 0 {
            return None;
        }
        self.slots[i] = v;
        self.len += 1;
        Some(i)
    }

    /// Index of the slot holding `key`, if any.
    pub fn find(&self, key: u64) -> Option<usize> {
        self.probe(key).ok()
    }

    /// The slot `key` would be found in first (for prefetching: reading it loads the line).
    #[inline]
    pub fn home(&self, key: u64) -> &V {
        &self.slots[reduce(key, self.slots.len())]
    }

    pub fn get(&self, i: usize) -> &V {
        &self.slots[i]
    }

    pub fn get_mut(&mut self, i: usize) -> &mut V {
        &mut self.slots[i]
    }

    /// Insert `v` (its key must be absent and the table not full); returns its slot.
    pub fn insert(&mut self, v: V) -> Option<usize> {
        if self.is_full() || v.key() == 0 {
            return None;
        }
        let n = self.slots.len();
        let mut i = reduce(v.key(), n);
        while self.slots[i].key() != 0 {
            i += 1;
            if i == n {
                i = 0;
            }
        }
        self.slots[i] = v;
        self.len += 1;
        Some(i)
    }

    /// Remove the entry in slot `i`, shifting later entries of its probe run back.
    pub fn remove_at(&mut self, mut i: usize) {
        let n = self.slots.len();
        if self.slots[i].key() == 0 {
            return;
        }
        self.len -= 1;
        let mut j = i;
        loop {
            j += 1;
            if j == n {
                j = 0;
            }
            let k = self.slots[j].key();
            if k == 0 {
                break;
            }
            let home = reduce(k, n);
            // Move j back to i if its home is not in the cyclic range (i, j].
            let in_range = if i <= j { i < home && home <= j } else { i < home || home <= j };
            if !in_range {
                self.slots[i] = self.slots[j];
                i = j;
            }
        }
        self.slots[i] = V::default();
    }

    /// Iterate over slot indices that hold entries, from `start`, wrapping once.
    pub fn occupied_from(&self, start: usize) -> impl Iterator<Item = usize> + '_ {
        let n = self.slots.len();
        (0..n).map(move |d| (start + d) % n).filter(move |&i| self.slots[i].key() != 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone, Copy, Default, PartialEq, Debug)]
    struct E(u64, u32);
    impl Entry for E {
        fn key(&self) -> u64 {
            self.0
        }
    }

    #[test]
    fn insert_find_remove_keep_every_other_key_reachable() {
        let mut t: OpenTable<E> = OpenTable::with_capacity(1000);
        let mut model = std::collections::HashMap::new();
        let mut x: u64 = 7;
        for step in 0..20_000u32 {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let key = (x >> 54) + 1; // few distinct keys: many collisions and removals
            match t.probe(key) {
                Ok(i) => {
                    assert_eq!(t.find(key), Some(i));
                    t.remove_at(i);
                    model.remove(&key);
                }
                Err(_) if t.is_full() => {}
                // Half the inserts into the slot the probe found, half probing again.
                Err(i) if step % 2 == 0 => {
                    assert_eq!(t.insert_at(i, E(key, step)), Some(i));
                    model.insert(key, step);
                }
                Err(_) => {
                    t.insert(E(key, step));
                    model.insert(key, step);
                }
            }
            if step % 997 == 0 {
                for (k, v) in &model {
                    let i = t.find(*k).expect("present key found");
                    assert_eq!(t.get(i).1, *v);
                }
                assert_eq!(t.len(), model.len());
            }
        }
        assert!(t.find(u64::MAX).is_none());
        assert!(t.insert(E(0, 0)).is_none(), "0 is the empty marker");
    }
}
