//! SHA-256 (FIPS 180-4) of two independent messages at once, with the x86 SHA extensions.
//!
//! Why: a block's prefix hash depends on its parent's, so one sequence's chain is hashed
//! strictly one block after another, and on x86 the SHA-NI round instruction is latency bound:
//! one compression keeps the unit mostly idle. Two chains of different sequences (a prefill
//! admits many prompts at once) have no dependency between them, so their rounds are issued
//! interleaved and overlap in the pipeline: about the time of one compression for two. This is
//! the "multi-buffer" technique of Intel's ISA-L crypto library (Gueron and Krasnov, "Parallel
//! hashing", ITNG 2012), here with two lanes of the SHA-NI instructions.
//!
//! The digest is exactly SHA-256's: the unit tests compare it with the portable implementation
//! for every padded length up to six blocks.

/// SHA-256 round constants (FIPS 180-4 §4.2.2).
const K: [u32; 64] = [
    0x428a_2f98,
    0x7137_4491,
    0xb5c0_fbcf,
    0xe9b5_dba5,
    0x3956_c25b,
    0x59f1_11f1,
    0x923f_82a4,
    0xab1c_5ed5,
    0xd807_aa98,
    0x1283_5b01,
    0x2431_85be,
    0x550c_7dc3,
    0x72be_5d74,
    0x80de_b1fe,
    0x9bdc_06a7,
    0xc19b_f174,
    0xe49b_69c1,
    0xefbe_4786,
    0x0fc1_9dc6,
    0x240c_a1cc,
    0x2de9_2c6f,
    0x4a74_84aa,
    0x5cb0_a9dc,
    0x76f9_88da,
    0x983e_5152,
    0xa831_c66d,
    0xb003_27c8,
    0xbf59_7fc7,
    0xc6e0_0bf3,
    0xd5a7_9147,
    0x06ca_6351,
    0x1429_2967,
    0x27b7_0a85,
    0x2e1b_2138,
    0x4d2c_6dfc,
    0x5338_0d13,
    0x650a_7354,
    0x766a_0abb,
    0x81c2_c92e,
    0x9272_2c85,
    0xa2bf_e8a1,
    0xa81a_664b,
    0xc24b_8b70,
    0xc76c_51a3,
    0xd192_e819,
    0xd699_0624,
    0xf40e_3585,
    0x106a_a070,
    0x19a4_c116,
    0x1e37_6c08,
    0x2748_774c,
    0x34b0_bcb5,
    0x391c_0cb3,
    0x4ed8_aa4a,
    0x5b9c_ca4f,
    0x682e_6ff3,
    0x748f_82ee,
    0x78a5_636f,
    0x84c8_7814,
    0x8cc7_0208,
    0x90be_fffa,
    0xa450_6ceb,
    0xbef9_a3f7,
    0xc671_78f2,
];

/// Whether this CPU has the instructions [`compress_x2`] needs (checked once, then cached).
pub(crate) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| {
            std::arch::is_x86_feature_detected!("sha")
                && std::arch::is_x86_feature_detected!("sse4.1")
                && std::arch::is_x86_feature_detected!("ssse3")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Runs the SHA-256 compression function over the 64-byte blocks of two padded messages of
/// the same length: `states[l]` is updated with `msgs[l]` (`msgs[l].len()` a multiple of 64,
/// equal for both lanes). Panics if [`available`] is false or the lengths disagree.
pub(crate) fn compress_x2(states: &mut [[u32; 8]; 2], msgs: [&[u8]; 2]) {
    assert!(available(), "SHA extensions not available");
    assert!(msgs[0].len() == msgs[1].len() && msgs[0].len() % 64 == 0);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `available()` checked that the CPU has SHA, SSE4.1 and SSSE3 (SSE2 is part of
    // x86_64); the message slices are read with unaligned loads within their bounds.
    unsafe {
        shani::compress_x2(states, msgs)
    }
}

#[cfg(target_arch = "x86_64")]
mod shani {
    use super::K;
    use std::arch::x86_64::*;

    /// The state as the SHA-NI round instruction wants it: lanes (high → low) `A B E F` and
    /// `C D G H`.
    #[inline(always)]
    unsafe fn load_state(s: &[u32; 8]) -> (__m128i, __m128i) {
        let abcd = _mm_loadu_si128(s.as_ptr().cast());
        let efgh = _mm_loadu_si128(s.as_ptr().add(4).cast());
        let badc = _mm_shuffle_epi32(abcd, 0xB1); // lanes low→high: b a d c
        let hgfe = _mm_shuffle_epi32(efgh, 0x1B); // lanes low→high: h g f e
        let abef = _mm_alignr_epi8(badc, hgfe, 8); // f e b a
        let cdgh = _mm_blend_epi16(hgfe, badc, 0xF0); // h g d c
        (abef, cdgh)
    }

    #[inline(always)]
    unsafe fn store_state(s: &mut [u32; 8], abef: __m128i, cdgh: __m128i) {
        let abef_rev = _mm_shuffle_epi32(abef, 0x1B); // a b e f
        let ghcd = _mm_shuffle_epi32(cdgh, 0xB1); // g h c d
        let abcd = _mm_blend_epi16(abef_rev, ghcd, 0xF0);
        let efgh = _mm_alignr_epi8(ghcd, abef_rev, 8);
        _mm_storeu_si128(s.as_mut_ptr().cast(), abcd);
        _mm_storeu_si128(s.as_mut_ptr().add(4).cast(), efgh);
    }

    /// Four message words of a block, big-endian bytes to `u32` lanes.
    #[inline(always)]
    unsafe fn load_words(block: &[u8], k: usize, bswap: __m128i) -> __m128i {
        _mm_shuffle_epi8(_mm_loadu_si128(block.as_ptr().add(16 * k).cast()), bswap)
    }

    /// Four rounds `4g..4g+4` on one lane: two round instructions of two rounds each.
    #[inline(always)]
    unsafe fn rounds4(abef: &mut __m128i, cdgh: &mut __m128i, w: __m128i, g: usize) {
        let wk = _mm_add_epi32(w, _mm_loadu_si128(K.as_ptr().add(4 * g).cast()));
        *cdgh = _mm_sha256rnds2_epu32(*cdgh, *abef, wk);
        *abef = _mm_sha256rnds2_epu32(*abef, *cdgh, _mm_shuffle_epi32(wk, 0x0E));
    }

    /// Message words `4g..4g+4` (g >= 4) from the four previous groups `w[(g-4)..g]` (a ring
    /// indexed by `g % 4`): W[t] = σ1(W[t-2]) + W[t-7] + σ0(W[t-15]) + W[t-16].
    #[inline(always)]
    unsafe fn schedule(w: &[__m128i; 4], g: usize) -> __m128i {
        let (w16, w12, w8, w4) = (w[g % 4], w[(g + 1) % 4], w[(g + 2) % 4], w[(g + 3) % 4]);
        let t = _mm_add_epi32(_mm_sha256msg1_epu32(w16, w12), _mm_alignr_epi8(w4, w8, 4));
        _mm_sha256msg2_epu32(t, w4)
    }

    #[target_feature(enable = "sha,sse2,ssse3,sse4.1")]
    pub(super) unsafe fn compress_x2(states: &mut [[u32; 8]; 2], msgs: [&[u8]; 2]) {
        let bswap = _mm_set_epi64x(0x0c0d_0e0f_0809_0a0b, 0x0405_0607_0001_0203);
        let (mut abef0, mut cdgh0) = load_state(&states[0]);
        let (mut abef1, mut cdgh1) = load_state(&states[1]);
        for (b0, b1) in msgs[0].chunks_exact(64).zip(msgs[1].chunks_exact(64)) {
            let (save_abef0, save_cdgh0, save_abef1, save_cdgh1) = (abef0, cdgh0, abef1, cdgh1);
            let mut w0 = [_mm_setzero_si128(); 4];
            let mut w1 = [_mm_setzero_si128(); 4];
            for g in 0..16 {
                // The two lanes' instructions alternate so that neither waits on its own
                // round latency alone.
                let (x0, x1) = if g < 4 {
                    (load_words(b0, g, bswap), load_words(b1, g, bswap))
                } else {
                    (schedule(&w0, g), schedule(&w1, g))
                };
                w0[g % 4] = x0;
                w1[g % 4] = x1;
                rounds4(&mut abef0, &mut cdgh0, x0, g);
                rounds4(&mut abef1, &mut cdgh1, x1, g);
            }
            abef0 = _mm_add_epi32(abef0, save_abef0);
            cdgh0 = _mm_add_epi32(cdgh0, save_cdgh0);
            abef1 = _mm_add_epi32(abef1, save_abef1);
            cdgh1 = _mm_add_epi32(cdgh1, save_cdgh1);
        }
        store_state(&mut states[0], abef0, cdgh0);
        store_state(&mut states[1], abef1, cdgh1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sha2::digest::generic_array::GenericArray;

    fn portable(state: &mut [u32; 8], msg: &[u8]) {
        for block in msg.chunks_exact(64) {
            sha2::compress256(state, std::slice::from_ref(GenericArray::from_slice(block)));
        }
    }

    #[test]
    fn two_lanes_match_the_portable_compression() {
        if !available() {
            eprintln!("no SHA extensions on this CPU: nothing to compare");
            return;
        }
        let mut x: u64 = 0x0123_4567_89ab_cdef;
        let mut byte = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        };
        for blocks in 0..=6 {
            for _ in 0..20 {
                let a: Vec<u8> = (0..64 * blocks).map(|_| byte()).collect();
                let b: Vec<u8> = (0..64 * blocks).map(|_| byte()).collect();
                let init: [[u32; 8]; 2] = [
                    std::array::from_fn(|i| {
                        (i as u32).wrapping_mul(0x9E37_79B9) ^ u32::from(byte())
                    }),
                    std::array::from_fn(|i| {
                        (i as u32).wrapping_mul(0x85EB_CA6B) ^ u32::from(byte())
                    }),
                ];
                let mut want = init;
                portable(&mut want[0], &a);
                portable(&mut want[1], &b);
                let mut got = init;
                compress_x2(&mut got, [&a, &b]);
                assert_eq!(got, want, "{blocks} blocks");
            }
        }
    }
}
