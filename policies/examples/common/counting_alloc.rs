//! A global allocator that counts calls, shared by the examples that print allocations per
//! decision (in the filter every allocation is a call into dlmalloc compiled to Wasm).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};

/// Counts allocations and reallocations; frees are not counted.
struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards to the system allocator unchanged; only counts calls.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        site(layout.size());
        // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System.alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        site(new_size);
        // SAFETY: as for `alloc` and `dealloc`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

pub fn allocs() -> u64 {
    ALLOCS.load(Ordering::Relaxed)
}

/// While on, each allocation prints its size and the crate frames that made it.
static SITES: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

thread_local! {
    /// Set while a site is being printed: the backtrace allocates too.
    static PRINTING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Print where each allocation comes from while `on` (for one decision: it is slow).
#[allow(dead_code)] // not every example lists sites
pub fn print_sites(on: bool) {
    SITES.store(on, Ordering::Relaxed);
}

fn site(bytes: usize) {
    if !SITES.load(Ordering::Relaxed) || PRINTING.with(std::cell::Cell::get) {
        return;
    }
    PRINTING.with(|p| p.set(true));
    let trace = std::backtrace::Backtrace::force_capture().to_string();
    let frames: Vec<&str> = trace
        .lines()
        .map(str::trim)
        .filter(|l| l.contains("attache") && !l.contains("counting_alloc") && !l.starts_with("at "))
        .map(|l| l.split_once(": ").map_or(l, |(_, f)| f))
        .take(3)
        .collect();
    eprintln!("  {bytes:>6} B  {}", frames.join(" < "));
    PRINTING.with(|p| p.set(false));
}
