//! `memory::release_free_pages` really gives freed heap pages back: pages freed below live
//! allocations stay resident under glibc until trimmed. Its own test binary (its own process), so
//! no other test's allocations move the resident-set figure it reads.
#![cfg(all(target_os = "linux", target_env = "gnu"))]

use kvsight_sidecar::memory::release_free_pages;

const PAGE: usize = 4096;

/// Resident pages of this process (`/proc/self/statm`'s second field) in bytes.
fn resident() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("statm");
    let pages: usize = statm
        .split_whitespace()
        .nth(1)
        .and_then(|f| f.parse().ok())
        .expect("statm's resident field");
    pages * PAGE
}

#[test]
fn freed_pages_below_live_allocations_go_back_when_trimmed() {
    // 64 MiB in 4 KiB chunks (far below glibc's mmap threshold: all on the heap), every page
    // written so it is resident; one chunk in 64 kept, so no free span reaches an arena's top
    // and glibc's own top-trimming cannot return it.
    const CHUNKS: usize = 16 * 1024;
    let mut chunks: Vec<Option<Vec<u8>>> = (0..CHUNKS).map(|i| Some(vec![i as u8; PAGE])).collect();
    let full = resident();
    for (i, c) in chunks.iter_mut().enumerate() {
        if i % 64 != 0 {
            *c = None;
        }
    }
    let freed = resident();
    // Precondition: freeing alone gave (almost) nothing back; otherwise this test shows nothing.
    assert!(
        full - freed.min(full) < 16 << 20,
        "glibc returned the pages without a trim: {full} → {freed} bytes resident"
    );
    assert!(release_free_pages(), "malloc_trim released nothing");
    let trimmed = resident();
    assert!(
        freed.saturating_sub(trimmed) > 32 << 20,
        "the trim gave back under 32 MiB of ~63 MiB freed: {freed} → {trimmed} bytes resident"
    );
    std::hint::black_box(&chunks);
}
